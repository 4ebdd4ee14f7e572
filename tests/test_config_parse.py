"""The value checks every config section uses: each names the key and says how to fix it."""

import pytest
from kvgate.config.parse import ConfigError, boolean, check_keys, integer, ms, num, section, shown


def test_milliseconds_become_seconds_within_their_range() -> None:
    assert ms({"t": 250}, "s", "t", 100, 1, 1000) == 0.25
    assert ms({}, "s", "t", 100, 1, 1000) == 0.1
    with pytest.raises(ConfigError, match=r"^s.t: 0 ms is out of range; use 1..3600000 ms$"):
        ms({"t": 0}, "s", "t", 100, 1, 3_600_000)
    with pytest.raises(ConfigError, match=r"expected a number of milliseconds, got True"):
        ms({"t": True}, "s", "t", 100, 1, 1000)


def test_integers_refuse_floats_and_booleans() -> None:
    assert integer({"n": 3}, "s", "n", 1, 0, 5) == 3
    for bad in (2.5, True, "3"):
        with pytest.raises(ConfigError, match=r"s.n: expected an integer"):
            integer({"n": bad}, "s", "n", 1, 0, 5)
    assert num({"x": 2}, "s", "x", 1.0, 0.5, 4.0) == 2.0


def test_booleans_are_true_or_false_only() -> None:
    assert boolean({}, "s", "b", True) is True
    with pytest.raises(ConfigError, match=r"s.b: expected true or false, got 'yes'"):
        boolean({"b": "yes"}, "s", "b", False)


def test_unknown_keys_and_non_mapping_sections_are_named() -> None:
    with pytest.raises(ConfigError, match=r"s: unknown key\(s\) zz; allowed: a, b"):
        check_keys({"a": 1, "zz": 2}, "s", {"a", "b"})
    assert section({"x": None}, "x") == {}
    with pytest.raises(ConfigError, match=r"x: expected a mapping of settings, got list"):
        section({"x": [1]}, "x")


def test_numbers_are_shown_as_written() -> None:
    assert (shown(3_600_000), shown(0.5), shown(1.0)) == ("3600000", "0.5", "1")
