"""A corpus of malformed requests, and a runner that sends it through a gateway.

Every field and header the gateway reads gets hostile values: invalid and truncated JSON, bytes that
are not UTF-8, lone surrogates raw and escaped, non-finite and out-of-range numbers, wrong types, huge
keys, deep nesting, odd content types. The corpus is deterministic for a seed. The runner sends each
case on its own connection and checks what kvgate promises: never a 5xx, every error is
OpenAI-style JSON, and the gateway is still whole afterwards.
"""

from __future__ import annotations

import json
import random
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

MODEL = "sim-model"
SURROGATES = [b"\xed\xa0\x80", b"\\ud800", b"\\udfff", b"\xed\xbf\xbf"]
NOT_UTF8 = [b"\xff", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xc3"]
NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"0x10", b"1e-400", b"-1", b"2.5",
           b"9223372036854775808", b"true", b'"5"', b"null", b"[]", b"{}"]  # fmt: skip
TYPES = [b"1", b"-3.5", b"true", b"null", b"[]", b"{}", b"[1,2]", b'{"a":1}', b'""', b'"x"']


@dataclass(frozen=True, slots=True)
class Case:
    path: str
    body: bytes
    headers: tuple[tuple[bytes, bytes], ...] = ()


def _valid(n: int) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"fuzz {n}"}], "max_tokens": 2}


def _encode(obj: object) -> bytes:
    return json.dumps(obj).encode()


def corpus(n: int, seed: int = 1) -> Iterator[Case]:
    """``n`` cases, cycling through the families below with random choices."""
    rng = random.Random(seed)
    chat, compl = "/v1/chat/completions", "/v1/completions"
    fields = [b"model", b"user", b"max_tokens", b"max_completion_tokens", b"stream", b"messages", b"prompt"]

    def with_field(name: bytes, raw: bytes, path: str = chat) -> Case:
        base = b'{"model":"sim-model","messages":[{"role":"user","content":"x"}],"max_tokens":2'
        if name == b"model":
            base = b'{"messages":[{"role":"user","content":"x"}],"max_tokens":2'
        return Case(path, base + b',"' + name + b'":' + raw + b"}")

    families = [
        # Truncated or otherwise broken JSON.
        lambda i: Case(chat, _encode(_valid(i))[: rng.randrange(0, 40)]),
        lambda i: Case(chat, _encode(_valid(i)).replace(b":", b"=", 1)),
        lambda i: Case(chat, rng.choice([b"[1,2]", b'"text"', b"42", b"null", b"{}", b"   ", b"{,}"])),
        # Bytes that are not UTF-8, and lone surrogates, in the fields the gateway reads and elsewhere.
        lambda i: with_field(
            rng.choice([b"model", b"user"]), b'"a' + rng.choice(SURROGATES + NOT_UTF8) + b'b"'
        ),
        lambda i: Case(chat, _encode(_valid(i)).replace(b"fuzz", b"fu" + rng.choice(SURROGATES + NOT_UTF8))),
        lambda i: Case(
            chat,
            _encode(_valid(i)),
            ((b"X-Session-ID", b"s-" + rng.choice(SURROGATES + NOT_UTF8)),),
        ),
        # Numbers that are not numbers, or not in range, or not of the right kind.
        lambda i: with_field(rng.choice([b"max_tokens", b"max_completion_tokens"]), rng.choice(NUMBERS)),
        lambda i: with_field(b"temperature", rng.choice(NUMBERS)),
        # Wrong types for every field.
        lambda i: with_field(rng.choice(fields), rng.choice(TYPES), rng.choice([chat, compl])),
        # Huge keys.
        lambda i: with_field(b"user", b'"' + b"u" * rng.choice([513, 4096, 100_000]) + b'"'),
        lambda i: with_field(b"model", b'"' + b"m" * rng.choice([257, 5000]) + b'"'),
        lambda i: Case(chat, _encode(_valid(i)), ((b"X-Session-ID", b"s" * rng.choice([513, 4000])),)),
        lambda i: Case(chat, _encode(_valid(i)), ((b"X-Session-ID", b"a"), (b"X-Session-ID", b"b"))),
        # Deep nesting.
        lambda i: Case(chat, b'{"a":' * (d := rng.choice([65, 200, 2000])) + b"1" + b"}" * d),
        lambda i: Case(chat, b'{"model":"sim-model","messages":' + b"[" * 300 + b"]" * 300 + b"}"),
        # Odd shapes the backend must judge.
        lambda i: Case(chat, _encode({"model": MODEL, "messages": [{"role": 5, "content": {"x": [1]}}]})),
        lambda i: Case(compl, _encode({"model": MODEL, "prompt": [[1, 2], {"a": None}], "max_tokens": 1})),
        lambda i: Case(
            chat, _encode({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 2000})
        ),
        # Headers: content types, a chunked body.
        lambda i: Case(
            chat, _encode(_valid(i)), ((b"Content-Type", rng.choice([b"text/plain", b"x/y", b""])),)
        ),
        lambda i: Case(chat, _encode(_valid(i)), ((b"Transfer-Encoding", b"chunked"),)),
    ]
    for i in range(n):
        yield families[i % len(families)](i)


def _raw(case: Case, key: str | None = None) -> bytes:
    headers = dict(case.headers)
    has_ct = any(k.lower() == b"content-type" for k in headers)
    lines = [b"POST " + case.path.encode() + b" HTTP/1.1", b"Host: fuzz", b"Connection: close"]
    if key is not None:  # a gateway with API keys: the hostile bytes are the body's, not the key's
        lines.append(b"Authorization: Bearer " + key.encode())
    if not has_ct:
        lines.append(b"Content-Type: application/json")
    body = case.body
    if headers.get(b"Transfer-Encoding") == b"chunked":
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    else:
        lines.append(b"Content-Length: %d" % len(body))
    lines += [k + b": " + v for k, v in case.headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass
class FuzzResult:
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0  # any 5xx
    non_json_errors: int = 0  # an error that is not JSON
    transport_errors: int = 0  # no answer at all
    examples: list[str] = field(default_factory=list)


def send(port: int, case: Case, key: str | None = None) -> tuple[int, bytes, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(_raw(case, key))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            k = int(size.split(b";")[0] or b"0", 16)
            if k == 0:
                break
            out, rest = out + rest[:k], rest[k + 2 :]
        body = out
    return status, head, body


def run(port: int, n: int, concurrency: int = 8, seed: int = 1, key: str | None = None) -> FuzzResult:
    result = FuzzResult()
    statuses: Counter[int] = Counter()
    cases = list(corpus(n, seed))
    lock = threading.Lock()
    it = iter(enumerate(cases))

    def worker() -> None:
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                return
            i, case = item
            try:
                status, _, body = send(port, case, key)
            except (OSError, ValueError, IndexError) as exc:
                with lock:
                    result.transport_errors += 1
                    if len(result.examples) < 10:
                        result.examples.append(f"case {i}: {type(exc).__name__}")
                continue
            bad = ""
            if status >= 500:
                bad = "5xx"
            elif status != 200:
                try:
                    json.loads(body)
                except ValueError:
                    bad = "not JSON"
            with lock:
                statuses[status] += 1
                result.server_errors += bad == "5xx"
                result.non_json_errors += bad == "not JSON"
                if bad and len(result.examples) < 10:
                    result.examples.append(f"case {i} ({case.path}, {case.body[:60]!r}): {status} {bad}")

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.requests = len(cases)
    result.statuses = {str(k): v for k, v in sorted(statuses.items())}
    return result
