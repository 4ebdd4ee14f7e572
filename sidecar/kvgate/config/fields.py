"""Each setting declared once: a config section is a frozen dataclass whose fields carry a ``Spec``
(kind, default, range, help), and one generic loader reads any section from that declaration.

Why dataclass metadata and not pydantic or msgspec: the sections stay the plain frozen dataclasses
the rest of kvgate reads (no second model type, no new dependency in the decision process), and the
error messages stay kvgate's own, naming the key and the fix, which a library's validation errors
would replace. The loader derives from the declaration: the keys a section accepts, each value's
parsing and message, durations written in ms and kept in seconds, and the reference page
(``kvgate config-reference``, docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from kvgate.config.parse import ConfigError, boolean, check_keys, integer, ms, num, section

SPEC = "kvgate"
T = TypeVar("T")
Reader = Callable[[Mapping[str, Any], str, str], Any]  # (section, where, key) -> value


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str  # ms, number, integer, flag, text, choice, nested, custom
    help: str
    default: Any  # as written in the file (ms for durations)
    lo: float | None = None
    hi: float | None = None
    choices: type[Enum] | None = None
    read: Reader | None = None  # custom kinds
    also: tuple[str, ...] = ()  # further keys a custom reader takes (e.g. password_file)
    item: type[Any] | None = None  # a list of declared entries (backends): their class

    def key(self, name: str) -> str:
        """The file's key: durations are kept in seconds (``_s``) and written in ms (``_ms``)."""
        return name[:-2] + "_ms" if self.kind == "ms" and name.endswith("_s") else name


def _field(spec: Spec, default: Any, secret: bool = False) -> Any:
    if default is dataclasses.MISSING:  # required
        return dataclasses.field(metadata={SPEC: spec})
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata={SPEC: spec})
    return dataclasses.field(default=default, repr=not secret, metadata={SPEC: spec})


def millis(default_ms: float | None, lo: float, hi: float, help: str) -> Any:
    """A duration written in ms, kept in seconds; ``None`` default: off unless given."""
    return _field(Spec("ms", help, default_ms, lo, hi), None if default_ms is None else default_ms / 1000)


def number(default: float | None, lo: float, hi: float, help: str) -> Any:
    return _field(Spec("number", help, default, lo, hi), None if default is None else float(default))


def whole(default: int | None, lo: int, hi: int, help: str) -> Any:
    return _field(Spec("integer", help, default, lo, hi), default)


def flag(default: bool, help: str) -> Any:
    return _field(Spec("flag", help, default), default)


def text(default: str | None, help: str) -> Any:
    return _field(Spec("text", help, default), default)


def choice(default: Enum, help: str) -> Any:
    return _field(Spec("choice", help, default.value, choices=type(default)), default)


def nested(cls: type[Any], help: str) -> Any:
    """A dataclass of its own whose keys sit in this section (``routing.load_factor``, ...)."""
    return dataclasses.field(default_factory=cls, metadata={SPEC: Spec("nested", help, None)})


def part(cls: type[Any], help: str) -> Any:
    """A section of the file: its own mapping under its key, read by ``load``."""

    def read_part(d: Mapping[str, Any], where: str, key: str) -> Any:
        return load(cls, section(d, key), key)

    return dataclasses.field(default_factory=cls, metadata={SPEC: Spec("custom", help, None, read=read_part)})


def custom(
    default: Any,
    read: Reader,
    help: str,
    shown: Any = None,
    also: tuple[str, ...] = (),
    secret: bool = False,
    item: type[Any] | None = None,
) -> Any:
    """A value with rules of its own (``read`` checks it); ``shown``: its default as the docs write
    it; ``secret``: never in a repr; ``item``: the declared class of each entry of a list."""
    spec = Spec("custom", help, default if shown is None else shown, read=read, also=also, item=item)
    return _field(spec, default, secret)


def specs(cls: type[Any]) -> Iterator[tuple[str, Spec]]:
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(SPEC)
        if spec is not None:
            yield f.name, spec


def keys(cls: type[Any]) -> set[str]:
    """Every key a section's mapping may hold."""
    out: set[str] = set()
    for name, spec in specs(cls):
        if spec.kind == "nested":
            out |= keys(_nested_type(cls, name))
        else:
            out |= {spec.key(name), *spec.also}
    return out


def _nested_type(cls: type[Any], name: str) -> type[Any]:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    assert field.default_factory is not dataclasses.MISSING
    return type(field.default_factory())


def read(spec: Spec, d: Mapping[str, Any], where: str, key: str) -> Any:
    """One value of ``d``, checked as ``spec`` declares (the default where the key is absent)."""
    if spec.kind == "custom":
        assert spec.read is not None
        return spec.read(d, where, key)
    value = d.get(key, spec.default)
    if value is None and spec.default is None and spec.kind != "flag":
        return None  # optional: off unless given
    if spec.kind == "ms":
        assert spec.lo is not None and spec.hi is not None
        return ms(d, where, key, spec.default, spec.lo, spec.hi)
    if spec.kind == "number":
        assert spec.lo is not None and spec.hi is not None
        return num(d, where, key, spec.default, spec.lo, spec.hi)
    if spec.kind == "integer":
        assert spec.lo is not None and spec.hi is not None
        return integer(d, where, key, spec.default, int(spec.lo), int(spec.hi))
    if spec.kind == "flag":
        return boolean(d, where, key, spec.default)
    if spec.kind == "text":
        return str(value)
    if spec.kind == "choice":
        assert spec.choices is not None
        try:
            return spec.choices(value)
        except ValueError:
            names = ", ".join(str(c.value) for c in spec.choices)
            raise ConfigError(f"{where}.{key}: unknown {key} {value!r}; choose one of {names}") from None
    raise AssertionError(spec.kind)


def values(cls: type[Any], d: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The declared fields of ``cls`` read from ``d`` (keys not checked: see ``load``)."""
    out: dict[str, Any] = {}
    for name, spec in specs(cls):
        if spec.kind == "nested":
            nested_cls = _nested_type(cls, name)
            out[name] = nested_cls(**values(nested_cls, d, where))
        else:
            out[name] = read(spec, d, where, spec.key(name))
    return out


def load(cls: type[T], d: Mapping[str, Any], where: str) -> T:
    """A section from its mapping: unknown keys refused, each value read as declared, then the
    section's own cross-field rules (its ``check(where)``, when it has one)."""
    check_keys(d, where, keys(cls))
    section = cls(**values(cls, d, where))
    check = getattr(section, "check", None)
    if check is not None:
        check(where)
    return section


def optional_text(d: Mapping[str, Any], where: str, key: str) -> str | None:
    value = d.get(key)
    return None if value is None else str(value)


def reference(config: type[Any]) -> str:
    """The configuration reference in Markdown, one table per section of ``config``, from the
    declarations."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the declarations in `sidecar/kvgate/config/` by `kvgate config-reference`;",
        "a test keeps this page equal to its output. Durations are written in milliseconds (`_ms`).",
    ]
    for f in dataclasses.fields(config):
        spec = f.metadata[SPEC]
        cls = type(f.default_factory()) if f.default_factory is not dataclasses.MISSING else spec.item
        out += ["", f"## `{f.name}`", ""]
        if spec.item is not None:
            out += [" ".join(spec.help.split()) + ". Each entry:", ""]
        doc = (cls.__doc__ or "").strip()
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [" ".join(doc.split()), ""]
        out += ["| key | default | range | meaning |", "|---|---|---|---|"]
        out += _rows(cls)
    return "\n".join(out) + "\n"


def _rows(cls: type[Any]) -> list[str]:
    rows = []
    for name, spec in specs(cls):
        if spec.kind == "nested":
            rows += _rows(_nested_type(cls, name))
            continue
        if spec.kind in ("ms", "number", "integer"):
            unit = " ms" if spec.kind == "ms" else ""
            span = f"{_shown(spec.lo)}..{_shown(spec.hi)}{unit}"
        elif spec.kind == "choice":
            assert spec.choices is not None
            span = ", ".join(str(c.value) for c in spec.choices)
        elif spec.kind == "flag":
            span = "true, false"
        else:
            span = ""
        default = "(none)" if spec.default is None else f"`{_shown(spec.default)}`"
        keys_ = ", ".join(f"`{k}`" for k in (spec.key(name), *spec.also))
        rows.append(f"| {keys_} | {default} | {span} | {' '.join(spec.help.split())} |")
    return rows


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}"
    return str(value)
