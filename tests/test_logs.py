"""The commands' logging options: a bad level is a usage error, JSON lines parse."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
from kvgate import logs


def test_levels_in_any_case_and_a_clear_error_for_the_rest() -> None:
    p = argparse.ArgumentParser()
    logs.add_arguments(p)
    assert p.parse_args(["--log-level", "info"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        p.parse_args(["--log-level", "loud"])


def test_json_lines_carry_level_logger_message_and_exception() -> None:
    record = logging.LogRecord("kvgate.app", logging.ERROR, __file__, 1, "scrape of %s failed", ("b1",), None)
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record.exc_info = sys.exc_info()
    line = json.loads(logs.JsonFormatter().format(record))
    assert line["level"] == "ERROR" and line["logger"] == "kvgate.app"
    assert line["msg"] == "scrape of b1 failed" and "ValueError: boom" in line["exc"]
    assert line["ts"].endswith("Z")
