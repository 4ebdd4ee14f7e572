"""Checks an existing Nginx edge before kvgate's drop-in include files go into it.

kvgate's routes run their decision in ``access_by_lua``, and Nginx lets a location's own
``access_by_lua*`` replace one inherited from the server or http level: an edge whose API-key check
is a server-level Lua access handler would silently not check kvgate's routes. ``kvgate
render-nginx --drop-in --edge-conf FILE`` reads the edge's configuration (following ``include``) and
refuses to render while such a handler exists, unless it is chained through ``gateway.edge_access``
(kvgate's routes call that module's ``access()`` first). Other access checks (``auth_basic``,
``auth_request``, ``allow``/``deny``) are not Lua handlers and apply to kvgate's routes as they are.

Where the edge already includes ``kvgate-server.conf``, only those servers (and the http level) are
checked; before that (a first render), every server is.
"""

from __future__ import annotations

import glob
import re
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_LUA = re.compile(r"access_by_lua(_block|_file)?$")
_TOKEN = re.compile(r"""\s+|#[^\n]*|"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|[{};]|[^\s{};"'#]+""")


class EdgeError(Exception):
    """The edge's configuration cannot be read, or would bypass its own access check."""


@dataclass
class Directive:
    name: str
    args: list[str]
    where: str  # file:line
    children: list[Directive] = field(default_factory=list)


_LUA_SKIP = re.compile(
    r"""--\[(=*)\[.*?\]\1\]|--[^\n]*|\[(=*)\[.*?\]\2\]|"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'""", re.S
)


def _skip_lua(text: str, pos: int) -> int:
    """Past the Lua block opened at ``pos`` (a ``{``): its code is not Nginx syntax. Braces inside
    Lua strings and comments do not count (as lua-nginx-module's own reader has it)."""
    depth = 0
    i = pos
    while i < len(text):
        m = _LUA_SKIP.match(text, i)
        if m is not None:
            i = m.end()
            continue
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise EdgeError("an unterminated *_by_lua_block")


def parse(path: Path, root: Path | None = None, depth: int = 0) -> list[Directive]:
    """The directives of ``path``, with ``include``s replaced by what they include (relative paths
    resolve from ``root``, the main file's directory, as Nginx resolves them from its prefix)."""
    if depth > 20:
        raise EdgeError(f"includes nest too deep at {path}")
    root = root or path.parent
    try:
        text = path.read_text()
    except OSError as exc:
        raise EdgeError(f"cannot read {path}: {exc.strerror}") from None
    stack: list[list[Directive]] = [[]]
    words: list[str] = []
    start_line = 1
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise EdgeError(f"{path}:{text.count(chr(10), 0, pos) + 1}: cannot read the configuration")
        token, pos = m.group(0), m.end()
        if token.isspace() or token.startswith("#"):
            continue
        if not words:
            start_line = text.count("\n", 0, m.start()) + 1
        where = f"{path}:{start_line}"
        if token == ";":
            if words:
                name, args = words[0], words[1:]
                if name == "include" and args:
                    pattern = args[0].strip("\"'")
                    full = pattern if pattern.startswith("/") else str(root / pattern)
                    for included in sorted(glob.glob(full)):
                        stack[-1].extend(parse(Path(included), root, depth + 1))
                else:
                    stack[-1].append(Directive(name, args, where))
            words = []
        elif token == "{":
            name = words[0] if words else ""
            if name.endswith("_by_lua_block"):
                stack[-1].append(Directive(name, words[1:], where))
                pos = _skip_lua(text, m.start())
            else:
                block = Directive(name, words[1:], where)
                stack[-1].append(block)
                stack.append(block.children)
            words = []
        elif token == "}":
            if len(stack) == 1:
                raise EdgeError(f"{where}: unbalanced }}")
            stack.pop()
        else:
            words.append(token.strip("\"'") if token[0] in "\"'" else token)
    return stack[0]


def bypassed_access(directives: list[Directive]) -> list[str]:
    """Where a Lua access handler sits that kvgate's locations would replace: http or server level
    (only the servers that include kvgate's routes, when any does)."""
    found: list[str] = []
    for http in (d for d in directives if d.name == "http"):
        found += [d.where for d in http.children if ACCESS_LUA.match(d.name)]
        servers = [d for d in http.children if d.name == "server"]
        hosting = [s for s in servers if any(_marks_kvgate(c) for c in s.children)]
        for server in hosting or servers:
            found += [d.where for d in server.children if ACCESS_LUA.match(d.name)]
    return found


def _marks_kvgate(d: Directive) -> bool:
    """kvgate's server include defines the location of its error pages: the mark of its routes."""
    return d.name == "location" and d.args[-1:] == ["/_kvgate/error"]


def check(edge_conf: Path, edge_access: str | None) -> None:
    """Raises EdgeError when the edge's own Lua access check would not apply to kvgate's routes."""
    found = bypassed_access(parse(edge_conf))
    if found and not edge_access:
        raise EdgeError(
            "the edge has an access_by_lua* handler at server or http level ("
            + ", ".join(found)
            + "), which kvgate's locations would replace: its check would not apply to kvgate's "
            "routes. Put it in a Lua module with an access() function and set gateway.edge_access "
            "to that module (kvgate's routes call it first), or move the check out of Lua "
            "(auth_request, auth_basic)."
        )
