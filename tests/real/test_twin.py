"""The simulator against real vLLM, signal by signal: one script of requests sent to a real server
and to a ``vllm-sim`` with the real server's cache geometry, and what each one's /metrics and
answers say after each step compared. Where kvgate relies on a signal (prompt and prefix-cache
counters, KV usage, the running count after a client leaves, the finish reasons counted, a request
for n completions, an over-long prompt's error), the simulator must say what vLLM says."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_port

from tests.conftest import wait_until
from tests.real.conftest import BLOCK_SIZE, BLOCKS, MODEL, RealFleet, get_text, post
from vllm_real.fleet import MAX_MODEL_LEN
from vllm_real.vocabulary import filler_words

pytestmark = pytest.mark.real


def scrape(url: str) -> dict[str, float]:
    """Every sample of the exposition, keyed by its line's name and labels."""
    out: dict[str, float] = {}
    for line in get_text(url + "/metrics").splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float], name: str) -> dict[str, float]:
    """The change of each series of ``name`` (by its labels, the server's model name left out)."""
    out = {}
    for key, value in after.items():
        if key == name or key.startswith(name + "{"):
            labels = ",".join(
                part for part in key[len(name) :].strip("{}").split(",") if part and "model_name" not in part
            )
            if value - before.get(key, 0.0):
                out[labels] = value - before.get(key, 0.0)
    return out


def total(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


def complete(url: str, prompt: str, max_tokens: int = 8) -> tuple[int, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    status, _, answer = post(url + "/v1/completions", body)
    return status, answer


def leave_mid_stream(url: str, prompt: str) -> None:
    """A stream read until its first tokens arrive, then the connection closed."""
    host, port = url.removeprefix("http://").split(":")
    raw = json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    ).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(raw) + raw
        )
        buf = b""
        while buf.count(b"data:") < 3:
            chunk = s.recv(65536)
            assert chunk, buf[:300]
            buf += chunk


def script(url: str, seed: str) -> dict[str, Any]:
    """What one server shows along the script, in terms of its own token counts."""
    seen: dict[str, Any] = {}
    prompt = " ".join(filler_words(f"twin-{seed}", 1000))
    status, body = post(url + "/tokenize", {"model": MODEL, "prompt": prompt})[::2]
    assert status == 200, body
    n = int(body["count"])
    cached = (n - 1) // BLOCK_SIZE * BLOCK_SIZE  # whole blocks, the last token always computed

    m0 = scrape(url)
    assert complete(url, prompt)[0] == 200
    m1 = scrape(url)
    # Counted in the server's own tokens: vLLM's tokenizer adds a BOS token, the simulator's does
    # not (its prompts must be exactly as long as their words), so each is compared with /tokenize.
    seen["first: prompt tokens counted, less /tokenize's count"] = (
        total(m1, "vllm:prompt_tokens_total") - total(m0, "vllm:prompt_tokens_total") - n
    )
    seen["first: prefix-cache queries, less /tokenize's count"] = (
        total(m1, "vllm:prefix_cache_queries_total") - total(m0, "vllm:prefix_cache_queries_total") - n
    )
    seen["first: prefix-cache hits"] = total(m1, "vllm:prefix_cache_hits_total") - total(
        m0, "vllm:prefix_cache_hits_total"
    )
    seen["first: finish reasons"] = delta(m0, m1, "vllm:request_success_total")
    # A finished request's blocks stay cached but count as free: usage is what running requests hold.
    seen["idle: KV usage"] = total(m1, "vllm:kv_cache_usage_perc")
    seen["idle: running, waiting"] = (
        total(m1, "vllm:num_requests_running"),
        total(m1, "vllm:num_requests_waiting"),
    )

    assert complete(url, prompt)[0] == 200
    m2 = scrape(url)
    hits = total(m2, "vllm:prefix_cache_hits_total") - total(m1, "vllm:prefix_cache_hits_total")
    seen["again: hits, as whole blocks less the last token"] = hits == cached

    leave_mid_stream(url, " ".join(filler_words(f"twin-leaver-{seed}", 300)))
    left = time.monotonic()
    wait_until(lambda: total(scrape(url), "vllm:num_requests_running") == 0, timeout=2.0, every=0.02)
    seen["left: the engine's request ended within 1 s"] = time.monotonic() - left < 1.0
    m3 = scrape(url)
    seen["left: finish reasons"] = delta(m2, m3, "vllm:request_success_total")
    seen["left: KV usage"] = total(m3, "vllm:kv_cache_usage_perc")

    assert complete(url, prompt)[0] == 200
    m4 = scrape(url)
    seen["after the abort: the prompt is still cached"] = (
        total(m4, "vllm:prefix_cache_hits_total") - total(m3, "vllm:prefix_cache_hits_total") == cached
    )

    # n completions: n engine requests, the later ones hitting the blocks the first was scheduled on
    fresh = " ".join(filler_words(f"twin-n-{seed}", 600))
    count = int(post(url + "/tokenize", {"model": MODEL, "prompt": fresh})[2]["count"])
    whole = (count - 1) // BLOCK_SIZE * BLOCK_SIZE
    m5 = scrape(url)
    body = {"model": MODEL, "prompt": fresh, "max_tokens": 4, "ignore_eos": True, "n": 3}
    status, _, answer = post(url + "/v1/completions", body)
    m6 = scrape(url)
    seen["n=3: status, choices, completion tokens"] = (
        status,
        [c["index"] for c in answer["choices"]],
        answer["usage"]["completion_tokens"],
    )
    seen["n=3: prompt tokens counted, per /tokenize's count"] = (
        total(m6, "vllm:prompt_tokens_total") - total(m5, "vllm:prompt_tokens_total")
    ) / count
    seen["n=3: hits, as the whole blocks of two completions"] = (
        total(m6, "vllm:prefix_cache_hits_total") - total(m5, "vllm:prefix_cache_hits_total") == 2 * whole
    )
    seen["n=3: cached tokens reported, as whole blocks"] = (
        answer["usage"]["prompt_tokens_details"]["cached_tokens"] == whole
    )
    seen["n=3: finish reasons"] = delta(m5, m6, "vllm:request_success_total")

    long_prompt = " ".join(filler_words(f"twin-long-{seed}", MAX_MODEL_LEN + 100))
    status, answer = complete(url, long_prompt)
    seen["over-long prompt: status, error type"] = (
        status,
        answer["error"]["type"] if status != 200 else None,
    )
    return seen


@pytest.fixture(scope="module")
def simulator(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One vllm-sim with the fleet's cache geometry (blocks of 128 tokens, ``BLOCKS`` of them)."""
    run = tmp_path_factory.mktemp("twin-sim")
    profile = Path(run) / "profile.json"
    profile.write_text(
        json.dumps(
            {
                "name": "twin",
                "t0_s": 0.004,
                "alpha_s": 1e-5,
                "beta_s": 3e-4,
                "gamma_s": 3e-4,
                "delta_s": 5e-5,
                "frontend_s": 0.02,
                "num_gpu_blocks": BLOCKS,
                "max_num_batched_tokens": 2048,
                "max_num_seqs": 128,
                "max_model_len": MAX_MODEL_LEN,
                "block_size": BLOCK_SIZE,
            }
        )
    )
    sup = Supervisor(Path(run) / "run")
    port = free_port()
    try:
        sup.start_sim(port, 1, "sim", "--model", MODEL, "--profile", str(profile))
        yield f"http://127.0.0.1:{port}"
    finally:
        sup.stop_all()


def test_the_simulator_shows_what_vllm_shows_along_one_script(fleet: RealFleet, simulator: str) -> None:
    real = script(fleet.urls[1], f"real-{time.time_ns()}")
    sim = script(simulator, "sim")
    print(json.dumps({"real": real, "sim": sim}, indent=1, default=str))
    assert real["first: prefix-cache hits"] == 0  # the script's prompt was new to the server
    assert real == sim
