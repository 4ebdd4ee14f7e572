"""Measures a real vLLM server and writes a ``vllm-sim`` profile that behaves like it.

The simulator counts one token per whitespace-separated word; the real server's tokenizer cuts a word
into ``k`` tokens (measured with its ``/tokenize``; about 1 for the vocabulary the tiny model was
trained on, ``vllm_real.vocabulary``, which the measurements and ``--words vocab`` prompts use). The
profile is written in words: a KV block holds ``block_size / k`` words, a prefill step's budget is
``max_num_batched_tokens / k`` words. Then the same workload sent to a simulated fleet with this
profile and to the real fleet should take the same time (``kvgate-bench real-vs-sim``).

What is measured (one thing at a time, medians of repeats):

* prefill: time to the first token of prompts of 256 to 12,000 words, each new to the cache, fitted to
  the simulator's step model summed over the chunks vLLM prefills a long prompt in (its budget):
  ``frontend + sum over chunks (t0 + alpha x chunk + delta x chunk x context / 1000)``: on a tiny
  model on a CPU the attention's quadratic part (delta) is most of a long prefill;
* decode: the time between tokens of ``b`` streams decoding together (b = 1, 4, 16), from the
  engine's own decode-time histogram, fitted to ``t0 + beta x b``; and with a 14,000-token context,
  which gives ``gamma`` (per 1,000 context words);
* the cache: ``block_size`` and ``num_gpu_blocks`` from ``vllm:cache_config_info``.

With ``--neighbours N`` the server is measured beside N others of the fleet, each kept busy by a
steady load (``--neighbour-streams`` streams of new prompts, one after another): a server of a loaded
fleet is as fast as its neighbours let it be. When the servers shared the machine's cores, a profile
from an idle machine made the simulated fleet 5x faster than the real one, and one measured beside a
neighbour varied with what the neighbour did at that instant (decode 1-6x, a prefill 2-16x slower
than alone). The fleet binds each server to a core of its own (``vllm_real.host``), as a GPU server
has its own device; a neighbour then still shares memory and caches (decode at 16 streams 2x slower
than on an idle machine), and a profile measured beside one holds the simulated pair within 15 % of
the real one in seconds (docs/real-vllm.md).

``python -m vllm_real.calibrate --out PROFILE.json`` starts a server of the fleet (or measures
``--url``); ``vllm-sim --profile PROFILE.json`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.tools.launcher import Supervisor

from vllm_real.fleet import MAX_MODEL_LEN, MODEL, Fleet, ServerSpec, metric
from vllm_real.vocabulary import filler_words

PREFILL_WORDS = (256, 512, 1024, 2048, 4096, 8192, 12_000)
DECODE_BATCHES = (1, 4, 16)
REPEATS = 3


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> float:
    """Seconds to the first token of one streamed completion (read to its end)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: {") and b'"text"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"no token from {url}")
    return first


def text(key: str, words: int) -> str:
    return " ".join(filler_words(key, words))


@dataclass(frozen=True, slots=True)
class Measured:
    tokens_per_word: float
    block_size_tokens: int
    num_gpu_blocks: int
    prefill: dict[int, float]  # words -> median TTFT (s)
    decode: dict[int, float]  # batch -> median time between tokens (s)
    long_context_words: int
    decode_long_context: float  # batch 1, that much context


LONG_CONTEXT_TOKENS = 14_000  # under the fleet's 16k max_model_len


def measure(url: str, model: str) -> Measured:
    probe = text("calibrate-probe", 2000)
    counted = _post(url + "/tokenize", {"model": model, "prompt": probe})["count"]
    k = counted / 2000
    metrics = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    info = next(line for line in metrics.splitlines() if line.startswith("vllm:cache_config_info{"))
    labels = dict(kv.split("=", 1) for kv in info[info.index("{") + 1 : info.index("}")].split(","))
    block = int(labels["block_size"].strip('"'))
    blocks = int(labels["num_gpu_blocks"].strip('"'))
    _stream(url, model, text("calibrate-warm", 64), 4)  # first request of a fresh server: warm-up
    prefill = {}
    for words in PREFILL_WORDS:
        if words * k > 16_000:
            continue
        ttfts = [_stream(url, model, text(f"calibrate-p{words}-{r}", words), 1) for r in range(REPEATS)]
        prefill[words] = statistics.median(ttfts)
    decode = {b: _decode(url, model, b, 64) for b in DECODE_BATCHES}
    long_words = int(LONG_CONTEXT_TOKENS / max(k, 1.0))
    return Measured(k, block, blocks, prefill, decode, long_words, _decode(url, model, 1, long_words))


def _decode_seconds(url: str) -> tuple[float, float]:
    """The server's own decode time so far (``vllm:request_decode_time_seconds``: from each request's
    first token to its last, stamped by the engine) and how many requests it covers."""
    name = "vllm:request_decode_time_seconds"
    return metric(url, name + "_sum"), metric(url, name + "_count")


def _decode(url: str, model: str, batch: int, prompt_words: int, tokens: int = 48) -> float:
    """Mean time between tokens of ``batch`` streams decoding ``tokens`` tokens together, from the
    engine's own timestamps: a client's view is not the engine's when the server is short of CPU (its
    API server then sends several tokens in one event, and events arrive in bursts)."""
    before, n0 = _decode_seconds(url)
    threads = [
        threading.Thread(
            target=_stream,
            args=(url, model, text(f"calibrate-d{batch}-{prompt_words}-{i}", prompt_words), tokens),
        )
        for i in range(batch)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after, n1 = _decode_seconds(url)
    if n1 - n0 != batch:
        raise RuntimeError(f"expected {batch} requests in the decode histogram, got {n1 - n0}")
    return (after - before) / (batch * (tokens - 1))


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Coefficients minimizing the squared error of rows . c = ys (normal equations, small n)."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan
        pivot = max(range(col, n), key=lambda r: abs(ata[r][col]))
        ata[col], ata[pivot] = ata[pivot], ata[col]
        aty[col], aty[pivot] = aty[pivot], aty[col]
        div = ata[col][col] or 1e-12
        ata[col] = [v / div for v in ata[col]]
        aty[col] /= div
        for r in range(n):
            if r != col:
                f = ata[r][col]
                ata[r] = [a - f * b for a, b in zip(ata[r], ata[col], strict=True)]
                aty[r] -= f * aty[col]
    return aty


def profile(
    m: Measured, name: str, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> dict[str, Any]:
    """A vllm-sim profile (vllm_sim.profiles.Profile's fields) in words of benchmark text."""
    k = m.tokens_per_word
    budget_words = max(1, int(max_num_batched_tokens / k))
    t0_decode, beta = _least_squares([[1.0, float(b)] for b in m.decode], list(m.decode.values()))
    t0_decode, beta = max(t0_decode, 1e-4), max(beta, 0.0)
    gamma = max(0.0, (m.decode_long_context - m.decode[1]) / (m.long_context_words / 1000.0))
    # TTFT(w) = frontend + sum over chunks (t0 + alpha n + delta n (start + n/2) / 1000), t0 the
    # decode fit's (one step's fixed cost): linear in (frontend, alpha, delta).
    # Each point is weighted by 1/TTFT so the fit minimises relative error: unweighted, the longest
    # prompt's seconds swamp the short ones (a 0.16 s "frontend" against a 27 ms measured TTFT).
    rows, ys, features = [], [], {}
    for w, ttft in m.prefill.items():
        chunks = [(s, min(budget_words, w - s)) for s in range(0, w, budget_words)]
        attention = sum(n * (s + n / 2) for s, n in chunks) / 1000.0
        features[w] = ([1.0, float(w), attention], t0_decode * len(chunks))
        rows.append([x / ttft for x in features[w][0]])
        ys.append((ttft - t0_decode * len(chunks)) / ttft)
    frontend, alpha, delta = _least_squares(rows, ys)
    coef = (max(frontend, 0.0), max(alpha, 1e-9), max(delta, 0.0))
    fitted = {
        w: steps + sum(c * x for c, x in zip(coef, f, strict=True)) for w, (f, steps) in features.items()
    }
    return {
        "name": name,
        "t0_s": t0_decode,
        "alpha_s": coef[1],
        "delta_s": coef[2],
        "beta_s": beta,
        "gamma_s": gamma,
        "frontend_s": coef[0],
        "num_gpu_blocks": m.num_gpu_blocks,
        "max_num_batched_tokens": budget_words,
        "max_num_seqs": max_num_seqs,
        "max_model_len": int(max_model_len / k),
        "block_size": max(1, round(m.block_size_tokens / k)),
        "measured": {
            "tokens_per_word": round(k, 4),
            "block_size_tokens": m.block_size_tokens,
            "prefill_ttft_s_by_words": {str(w): round(v, 5) for w, v in m.prefill.items()},
            "prefill_fit_over_measured": {str(w): round(fitted[w] / v, 3) for w, v in m.prefill.items()},
            "decode_itl_s_by_batch": {str(b): round(v, 5) for b, v in m.decode.items()},
            f"decode_itl_s_at_{m.long_context_words}_words": round(m.decode_long_context, 5),
        },
    }


NEIGHBOUR_PROMPT_WORDS = 1000
NEIGHBOUR_OUTPUT_TOKENS = 200


class NeighbourLoad:
    """Keeps servers busy: ``streams`` streams each, every one a new prompt, until stopped."""

    def __init__(self, urls: Sequence[str], model: str, streams: int) -> None:
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(url, model, f"neighbour-{n}-{i}"), daemon=True)
            for n, url in enumerate(urls)
            for i in range(streams)
        ]

    def _loop(self, url: str, model: str, key: str) -> None:
        r = 0
        while not self._stop.is_set():
            _stream(url, model, text(f"{key}-{r}", NEIGHBOUR_PROMPT_WORDS), NEIGHBOUR_OUTPUT_TOKENS)
            r += 1

    def __enter__(self) -> NeighbourLoad:
        for t in self._threads:
            t.start()
        time.sleep(5.0)  # past the neighbours' first prefills: measure beside a steady load
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m vllm_real.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start one of the fleet's and stop it after)")
    p.add_argument("--out", type=Path, required=True, help="the profile to write (JSON)")
    p.add_argument("--name", default="vllm-cpu-tiny")
    p.add_argument("--run-dir", type=Path, default=Path(".run/calibrate"))
    p.add_argument("--neighbours", type=int, default=0, help="busy servers beside the measured one")
    p.add_argument("--neighbour-streams", type=int, default=4, help="streams each neighbour serves")
    args = p.parse_args(argv)
    spec = ServerSpec()
    sup = Supervisor(args.run_dir)
    try:
        urls = Fleet(sup).start([spec] * (args.neighbours + (0 if args.url else 1)))
        url = args.url or urls.pop(0)
        with NeighbourLoad(urls, MODEL, args.neighbour_streams) if urls else contextlib.nullcontext():
            m = measure(url, MODEL)
    finally:
        sup.stop_all()
    out = profile(m, args.name, spec.max_num_batched_tokens, spec.max_num_seqs, MAX_MODEL_LEN)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["measured"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
