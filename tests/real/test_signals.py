"""What kvgate reads from a real vLLM: its metrics, and when a stream's first token leaves."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest
from kvgate.config import GatewayConfig
from kvgate.first_byte import FirstByteBudget, attention_of
from kvgate.scraper import LABELLED_SERIES, SERIES, parse_metrics

from tests.conftest import wait_until
from tests.real.conftest import BLOCK_SIZE, BLOCKS, MODEL, Gateway, RealFleet, Tokens, get_text

pytestmark = pytest.mark.real


def test_every_series_kvgate_reads_comes_from_the_real_exposition(fleet: RealFleet, kvgate: Gateway) -> None:
    """Running, waiting, waiting for KV, KV usage, the prefix-cache counters, prompt tokens and the
    cache geometry are all found in vLLM 0.32's own /metrics, and reach /v1/backends."""
    for url in fleet.urls:
        text = get_text(url + "/metrics")
        # Each series kvgate reads is there by one of its names (a counter with or without _total):
        # a name vLLM does not use would read as no load at all, not as an error.
        exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
        exposed |= {name.removesuffix("_total") for name in exposed}
        for kind, names in SERIES.items():
            assert exposed & set(names), (kind, names)
        assert set(LABELLED_SERIES) <= exposed, LABELLED_SERIES
        s = parse_metrics(text, 0.0)
        assert s.running == 0 and s.waiting == 0
        assert s.kv_usage is not None and s.waiting_for_kv == 0
        assert s.prefix_queries is not None and s.prefix_hits is not None and s.prompt_tokens is not None
        assert (s.block_size, s.kv_blocks) == (BLOCK_SIZE, BLOCKS)
    wait_until(lambda: all(b["load"]["known"] for b in kvgate.backends().values()), timeout=10)
    for b in kvgate.backends().values():
        assert b["cache"] == {"block_size": BLOCK_SIZE, "blocks": BLOCKS}
        assert b["state"] == "healthy" and b["models"] == [MODEL]


def test_a_burst_shows_in_the_backends_load_and_falls_back(kvgate: Gateway, tokens: Tokens) -> None:
    """Eight concurrent long streams: vLLM's running and waiting counts, as kvgate scrapes them,
    and kvgate's own in-flight counts show at least half of them; when they end, all fall back to
    zero. The load is sampled from the moment the streams are sent until the peaks are seen or
    every stream has ended: a burst of short answers was over between two scrapes on a fast host,
    and sampling only once every stream had its first token missed the burst in one run here
    (peaks of 2: by the last first token, six streams had ended)."""
    body = {"model": MODEL, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    done: list[int] = []
    t0 = time.monotonic()

    def one(i: int) -> None:
        content = tokens.text(2000, 1000 + i)
        raw = json.dumps({**body, "messages": [{"role": "user", "content": content}]}).encode()
        req = urllib.request.Request(
            kvgate.url + "/v1/chat/completions", raw, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            first, at = True, float("nan")
            for line in r:
                if first and line.startswith(b"data:"):
                    first = False
                    at = time.monotonic() - t0
            done.append(r.status)
            where = f"{r.headers['X-Kvgate-Backend']} ({r.headers['X-Kvgate-Route']})"
            print(f"stream {i}: {where}, first token at {at:.2f} s, ended at {time.monotonic() - t0:.2f} s")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    peak = {"load": 0.0, "inflight": 0}

    def seen() -> bool:
        backends = kvgate.backends().values()
        peak["load"] = max(peak["load"], sum(b["load"]["requests"] for b in backends))
        peak["inflight"] = max(peak["inflight"], sum(b["inflight"] for b in backends))
        return peak["load"] >= 4 and peak["inflight"] >= 4

    wait_until(lambda: seen() or not any(t.is_alive() for t in threads), timeout=60)
    running = sum(t.is_alive() for t in threads)
    load, inflight = peak["load"], peak["inflight"]
    print(f"peak: vLLM running + waiting {load:.0f}, kvgate in flight {inflight}; {running} ran on")
    assert peak["load"] >= 4 and peak["inflight"] >= 4, (peak, running)
    for t in threads:
        t.join(120)
    assert done == [200] * 8
    wait_until(
        lambda: all(
            b["load"]["requests"] == 0
            and b["inflight"] == b["inflight_tokens"] == b["inflight_kv_tokens"] == 0
            for b in kvgate.backends().values()
        ),
        timeout=5,
    )


BODY = {"model": MODEL, "max_tokens": 2, "ignore_eos": True, "stream": True}


def stream_timings(port: int, body: dict[str, object]) -> tuple[float, float]:
    """(seconds to the response headers, seconds to the first `data:` event) as the client sees them."""
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        t0 = time.monotonic()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw
        )
        buf, headers_at = b"", None
        while True:
            chunk = s.recv(65536)
            assert chunk, buf[:300]
            buf += chunk
            if headers_at is None and b"\r\n\r\n" in buf:
                headers_at = time.monotonic() - t0
            if headers_at is not None and b"data:" in buf.split(b"\r\n\r\n", 1)[1]:
                return headers_at, time.monotonic() - t0


def test_the_gateways_ttft_is_the_first_token_not_the_headers(kvgate: Gateway, tokens: Tokens) -> None:
    """vLLM sends a stream's headers when it accepts the request and its first event with the first
    token. For a 12k-token prompt the gateway's TTFT (its first body byte) is within 10 % of what
    the client measures, and far from the header time: the headers come in a few tens of
    milliseconds, the first token after half a second. (The client's own wakeup on a host whose
    cores vLLM's prefill saturates was seen 28 and 40 ms late in CI runs, over a 3 % bound of 16 ms
    once the server got faster. An 8k-token prompt took 0.25 s on a fast host: too close to the
    header time's own noise to tell the two apart with margin.)"""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": tokens.text(12_000, 7)}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
    }
    before = kvgate.sidecar_metric("kvgate_gateway_ttft_seconds_sum")
    count = kvgate.sidecar_metric("kvgate_gateway_ttft_seconds_count")
    headers_at, first_at = stream_timings(kvgate.port, body)
    wait_until(lambda: kvgate.sidecar_metric("kvgate_gateway_ttft_seconds_count") == count + 1, timeout=5)
    gateway = kvgate.sidecar_metric("kvgate_gateway_ttft_seconds_sum") - before
    assert abs(gateway - first_at) < max(0.050, 0.1 * first_at), (gateway, first_at)
    print(f"headers after {headers_at:.3f} s, first token after {first_at:.3f} s, gateway {gateway:.3f} s")
    assert first_at > 0.2 and headers_at < first_at / 3, (headers_at, first_at)


def test_a_short_prompt_behind_a_long_one_is_answered_when_the_long_prefill_is_done(
    fleet: RealFleet, tokens: Tokens
) -> None:
    """What the gateway's room for a request rests on (``Snapshot.fits``): vLLM schedules the
    prefill it is running before one that waits, in steps of its token budget, so a short prompt
    that reaches a server while a long one prefills gets its first token with the long one's last
    chunk, however short it is: many times its TTFT alone."""
    port = int(fleet.urls[0].rsplit(":", 1)[1])

    def body(n: int, seed: int) -> dict[str, object]:
        text = tokens.text(n, seed)
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 2,
            "ignore_eos": True,
            "stream": True,
        }

    alone = min(stream_timings(port, body(100, 9100 + i))[1] for i in range(3))
    out: dict[str, float] = {}

    def long() -> None:
        t0 = time.monotonic()
        out["long_at"] = t0 + stream_timings(port, body(14_000, 9200))[1]
        out["long_ttft"] = out["long_at"] - t0

    worker = threading.Thread(target=long)
    worker.start()
    time.sleep(0.15)  # the long prompt is in its prefill
    t0 = time.monotonic()
    short = stream_timings(port, body(100, 9300))[1]
    worker.join()
    assert out["long_ttft"] > 0.4, out  # long enough to arrive during it
    assert t0 + short > out["long_at"] - 0.2 * out["long_ttft"], (short, out)
    assert short > 4 * alone, (short, alone)


def test_the_first_byte_fit_follows_a_prefill_that_grows_faster_than_its_prompt(
    fleet: RealFleet, tokens: Tokens
) -> None:
    """The expected first byte (``kvgate.first_byte``) rests on how a prefill's time grows with the
    prompt. On this model each token's attention to the context is most of a long prefill, so the
    time grows faster than the tokens: fitted on answers of 256 to 8,192 tokens, a line in tokens
    misses a 12,000-token prompt by more than the fit that also learns attention, which comes
    within a third of it."""
    port = int(fleet.urls[0].rsplit(":", 1)[1])
    fit, line = FirstByteBudget(GatewayConfig()), FirstByteBudget(GatewayConfig())

    def ttft(n: int, seed: int) -> float:  # a new prompt each time: nothing cached
        return stream_timings(
            port, {**BODY, "messages": [{"role": "user", "content": tokens.text(n, seed)}]}
        )[1]

    for i, n in enumerate([256, 512, 1024, 2048, 3072, 4096, 6144, 8192] * 2):
        seconds = ttft(n, 9400 + i)
        fit.learn("a", n, seconds, attention_of(n, n))
        line.learn("a", n, seconds)
    took = ttft(12_000, 9500)
    expected = fit.predict("a", 12_000, attention_of(12_000, 12_000))
    naive = line.predict("a", 12_000)
    assert expected is not None and naive is not None
    print(f"12,000 tokens: took {took:.3f} s, fit {expected:.3f} s, line {naive:.3f} s")
    assert abs(expected - took) < abs(naive - took), (took, expected, naive)
    assert abs(expected - took) < took / 3, (took, expected, naive)
