"""Benchmark workloads: one definition, replayed in virtual time or sent over HTTP.

A workload is a list of ``BenchRequest``: when it arrives, what to send, and the exact output length
(``max_tokens`` with ``ignore_eos``). Prompt text and token ids (under the simulator's tokenizer: one
word = one token) are built on demand, since a whole trace held as text would take gigabytes.

* ``trace``: a Mooncake-format JSONL trace. Each hash id becomes a deterministic block of 512 words
  (same id, same text), the last block cut to fit ``input_length``; sent to ``/v1/completions``.
* ``chat``: synthetic multi-turn chat: users with one of a few shared system prompts, conversations
  that grow each turn (the previous answer is sent back), think time between turns; with or without
  a session header.
* ``mixed``: long RAG documents with short questions, plus short chats.
* ``reuse``: reuse-rich traffic with a knob (``--reuse``): requests ask about documents (in the
  system prompt) and extend conversation trees about them; a share ``reuse`` of requests returns to
  an earlier document (Zipf popularity) or conversation, the rest bring a new document.

Over 300 lines: every workload the benchmarks name, side by side, so one can be compared with
another in one read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvgate_bench import pressure, report
from vllm_real import vocabulary
from vllm_sim import tokenizer

TRACE_BLOCK_TOKENS = 512
SIM_MODEL = "sim-model"  # what the simulated fleets of virtual, compare and twin serve
# The Mooncake conversation trace, shipped with the benchmark (traces/README.md: source, licence);
# --trace takes any other in the same format.
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace.jsonl"


# The words prompts are written with: the simulator's filler (one token each to a simulator), or the
# vocabulary the real fleet's tiny model tokenizes one to one (--words vocab: a prompt then has about
# as many tokens on a real vLLM as on a simulator).
Filler = Callable[[int | str, int], list[str]]
FILLERS: dict[str, Filler] = {"filler": tokenizer.filler_words, "vocab": vocabulary.filler_words}


# Conversations reuse their blocks within minutes, so a few thousand cached blocks serve a whole trace.
@lru_cache(maxsize=8192)
def _block_words(hash_id: int, words: str = "filler", size: int = TRACE_BLOCK_TOKENS) -> tuple[str, ...]:
    return tuple(FILLERS[words](f"trace-block-{hash_id}", size))


@lru_cache(maxsize=8192)
def _block_ids(hash_id: int, words: str = "filler", size: int = TRACE_BLOCK_TOKENS) -> tuple[int, ...]:
    return tuple(tokenizer.word_id(w) for w in _block_words(hash_id, words, size))


@dataclass(frozen=True, slots=True)
class BenchRequest:
    rid: int
    arrival: float  # seconds from the start, before any speed-up
    output_tokens: int
    prompt_tokens: int
    model: str = "sim-model"
    blocks: tuple[int, ...] = ()  # trace: 512-token block ids of a completions prompt
    messages: tuple[dict[str, str], ...] = ()  # chat workloads
    headers: dict[str, str] = field(default_factory=dict)
    words: str = "filler"  # trace: which FILLERS writes its blocks
    block_tokens: int = TRACE_BLOCK_TOKENS  # trace: tokens each hash id stands for (scaled traces)
    asks: int | None = None  # max_tokens asked, when more than it writes (virtual: ignore_eos writes all)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages else "/v1/completions"

    def _trace_words(self) -> list[str]:
        words: list[str] = []
        for h in self.blocks:
            take = min(self.block_tokens, self.prompt_tokens - len(words))
            if take <= 0:
                break
            words.extend(_block_words(h, self.words, self.block_tokens)[:take])
        return words

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.output_tokens if self.asks is None else self.asks,
            "ignore_eos": True,
            "stream": True,
        }
        if self.messages:
            out["messages"] = list(self.messages)
        else:
            out["prompt"] = " ".join(self._trace_words())
        return out

    def prompt_ids(self) -> list[int]:
        if self.messages:
            return tokenizer.encode(tokenizer.render_chat(self.messages))
        ids: list[int] = []
        for h in self.blocks:
            take = min(self.block_tokens, self.prompt_tokens - len(ids))
            if take <= 0:
                break
            ids.extend(_block_ids(h, self.words, self.block_tokens)[:take])
        return ids


def load_trace(
    path: Path,
    start_s: float = 0.0,
    duration_s: float | None = None,
    limit: int | None = None,
    model: str = "sim-model",
    spread: bool = False,
) -> list[BenchRequest]:
    """The trace's requests in ``[start_s, start_s + duration_s)``, arrivals counted from ``start_s``.
    ``spread`` resolves requests that share a timestamp into arrivals spread over the interval
    to the next timestamp (see ``spread_ties``)."""
    out: list[BenchRequest] = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            t = row["timestamp"] / 1000.0
            if t < start_s:
                continue
            if duration_s is not None and t >= start_s + duration_s:
                break
            out.append(
                BenchRequest(
                    len(out),
                    t - start_s,
                    max(1, int(row["output_length"])),
                    int(row["input_length"]),
                    model,
                    tuple(row["hash_ids"]),
                )
            )
            if limit is not None and len(out) >= limit:
                break
    return spread_ties(out) if spread else out


def spread_ties(reqs: list[BenchRequest], seed: int = 0) -> list[BenchRequest]:
    """Requests that share a timestamp, spread over the interval to the next distinct one.

    The conversation trace's timestamps come in 3-second slots (1,180 distinct values for 12,031
    requests), so sent as written every slot is one burst of ~10 simultaneous requests, and which of
    them an engine sees first is decided by the sender's and the server's HTTP stacks, not by the
    trace (live, shorter bodies win; a replay keeps the file's order). Spread, each slot's requests
    arrive at sorted uniform offsets in the file's order (Poisson arrivals given their count), so
    the order is the trace's everywhere. A request with a timestamp of its own keeps it, and the
    last slot spreads over the median interval."""
    times = sorted({r.arrival for r in reqs})
    gaps = [b - a for a, b in itertools.pairwise(times)]
    width_of = dict(zip(times, gaps, strict=False))
    last_width = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    rng = random.Random(seed)
    out: list[BenchRequest] = []
    for t, group in itertools.groupby(reqs, key=lambda r: r.arrival):
        slot = list(group)
        if len(slot) == 1:
            out.extend(slot)
            continue
        offsets = sorted(rng.random() * width_of.get(t, last_width) for _ in slot)
        out.extend(replace(r, arrival=t + dt) for r, dt in zip(slot, offsets, strict=True))
    return out


def _chat_request(
    rid: int,
    t: float,
    messages: list[dict[str, str]],
    n_out: int,
    model: str,
    headers: dict[str, str] | None = None,
) -> BenchRequest:
    n_in = tokenizer.count(tokenizer.render_chat(messages))
    return BenchRequest(rid, t, n_out, n_in, model, (), tuple(messages), headers or {})


def synthetic_chat(
    users: int = 64,
    turns: int = 6,
    system_prompts: int = 3,
    system_tokens: int = 1500,
    question_tokens: int = 120,
    answer_tokens: int = 200,
    think_s: float = 20.0,
    span_s: float = 120.0,
    session_header: bool = False,
    seed: int = 1,
    model: str = "sim-model",
    filler: Filler = tokenizer.filler_words,
) -> list[BenchRequest]:
    """Conversations that resend their whole history each turn, with think time between turns."""
    rng = random.Random(seed)
    systems = [" ".join(filler(f"system-{i}", system_tokens)) for i in range(system_prompts)]
    events: list[tuple[float, int, list[dict[str, str]]]] = []
    for u in range(users):
        t = rng.uniform(0, span_s)
        messages = [{"role": "system", "content": systems[u % system_prompts]}]
        for turn in range(turns):
            q = " ".join(filler(f"user-{u}-q{turn}", question_tokens))
            messages = [*messages, {"role": "user", "content": q}]
            events.append((t, u, list(messages)))
            answer = " ".join(tokenizer.output_words(u * 1000 + turn, answer_tokens))
            messages = [*messages, {"role": "assistant", "content": answer}]
            t += rng.expovariate(1.0 / think_s)
    events.sort(key=lambda e: e[0])
    return [
        _chat_request(i, t, m, answer_tokens, model, {"X-Session-ID": f"user-{u}"} if session_header else {})
        for i, (t, u, m) in enumerate(events)
    ]


def mixed(
    documents: int = 8,
    doc_tokens: int = 16_000,
    rag_questions: int = 120,
    chats: int = 120,
    span_s: float = 120.0,
    seed: int = 2,
    model: str = "sim-model",
    filler: Filler = tokenizer.filler_words,
) -> list[BenchRequest]:
    """Long documents asked short questions (RAG), interleaved with short independent chats."""
    rng = random.Random(seed)
    docs = [" ".join(filler(f"doc-{d}", doc_tokens)) for d in range(documents)]
    events: list[tuple[float, list[dict[str, str]], int]] = []
    for q in range(rag_questions):
        question = " ".join(filler(f"rag-q{q}", 40))
        events.append(
            (
                rng.uniform(0, span_s),
                [
                    {"role": "system", "content": docs[rng.randrange(documents)]},
                    {"role": "user", "content": question},
                ],
                60,
            )
        )
    for c in range(chats):
        msg = " ".join(filler(f"short-{c}", rng.randint(20, 200)))
        events.append((rng.uniform(0, span_s), [{"role": "user", "content": msg}], rng.randint(50, 300)))
    events.sort(key=lambda e: e[0])
    return [_chat_request(i, t, m, n, model) for i, (t, m, n) in enumerate(events)]


def reuse_rich(
    reuse: float = 0.8,
    requests: int = 1200,
    rate: float = 4.0,
    doc_tokens: tuple[int, int] = (2000, 6000),
    question_tokens: int = 60,
    answer_tokens: int = 120,
    zipf: float = 1.1,
    follow_up: float = 0.5,
    seed: int = 3,
    model: str = "sim-model",
    filler: Filler = tokenizer.filler_words,
) -> list[BenchRequest]:
    """Documents asked about again and again, and conversations about them that grow.

    Each request (Poisson arrivals at ``rate`` per second), with probability ``reuse``, returns to a
    document seen before (the k-th document drawn with weight ``1 / k**zipf``): with probability
    ``follow_up`` it continues one of that document's conversations (history + the answer it got +
    a new question), else it opens a new conversation on it. Otherwise it brings a new document.
    """
    rng = random.Random(seed)
    docs: list[str] = []
    threads: list[list[list[dict[str, str]]]] = []  # per document: each conversation's messages
    out: list[BenchRequest] = []
    t = 0.0
    for rid in range(requests):
        t += rng.expovariate(rate)
        question = " ".join(filler(f"reuse-q{seed}-{rid}", question_tokens))
        if docs and rng.random() < reuse:
            weights = [1.0 / (k + 1) ** zipf for k in range(len(docs))]
            d = rng.choices(range(len(docs)), weights)[0]
        else:
            n = rng.randint(*doc_tokens)
            docs.append(" ".join(filler(f"reuse-doc{seed}-{len(docs)}", n)))
            threads.append([])
            d = len(docs) - 1
        convs = threads[d]
        if convs and rng.random() < follow_up:
            c = rng.randrange(len(convs))
            answer = " ".join(tokenizer.output_words(rid, answer_tokens))
            messages = [
                *convs[c],
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
            convs[c] = messages
        else:
            messages = [{"role": "system", "content": docs[d]}, {"role": "user", "content": question}]
            convs.append(messages)
        out.append(_chat_request(rid, t, list(messages), answer_tokens, model))
    return out


def add_workload_args(p: argparse.ArgumentParser) -> None:
    report.add_slo_args(p)  # every command that runs a workload reports goodput at an SLO
    p.add_argument(
        "--workload",
        choices=["trace", "chat", "chat-sessions", "mixed", "reuse", "pressure"],
        default="trace",
    )
    p.add_argument(
        "--reuse", type=float, default=0.8, help="reuse workload: share of requests that come back"
    )
    p.add_argument("--rate", type=float, default=4.0, help="reuse workload: arrivals per second")
    pressure.add_pressure_args(p)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--start", type=float, default=0.0, help="trace window start (s)")
    p.add_argument("--duration", type=float, default=None, help="trace window length (s)")
    p.add_argument("--limit", type=int, default=None, help="at most this many requests")
    add_scale_args(p)
    p.add_argument(
        "--model", default=None, help=f"the model to ask for (live: the URL's first model; else {SIM_MODEL})"
    )
    p.add_argument(
        "--words",
        choices=sorted(FILLERS),
        default="filler",
        help="what prompts are written with: the simulator's filler words, or the vocabulary the real "
        "fleet's tiny model tokenizes one word to one token (for runs on real vLLM)",
    )
    p.add_argument(
        "--arrivals",
        choices=["file", "spread"],
        default="file",
        help="trace: send requests that share a timestamp together (file) or spread over its slot",
    )


def add_scale_args(p: argparse.ArgumentParser) -> None:
    """How a trace is fitted to a fleet: its block size, and the longest request a server takes."""
    block = (
        "trace: tokens each of its hash ids stands for (512 as recorded; fewer scales every prompt down "
        "by that ratio and keeps which prompts share which prefixes)"
    )
    p.add_argument("--trace-block-tokens", type=int, default=TRACE_BLOCK_TOKENS, help=block)
    most = "drop requests whose prompt plus answer exceed this many tokens (a server's max_model_len)"
    p.add_argument("--max-context", type=int, default=None, help=most)


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The workload the command line of ``add_workload_args`` asks for."""
    model = args.model or SIM_MODEL
    words = getattr(args, "words", "filler")
    if args.workload == "trace":
        if not args.trace.exists():
            raise SystemExit(f"kvgate-bench: trace {args.trace} not found; pass --trace PATH")
        trace = load_trace(args.trace, args.start, args.duration, None, model, args.arrivals == "spread")
        block = getattr(args, "trace_block_tokens", TRACE_BLOCK_TOKENS)
        return _bounded(scaled(trace, words, block), args)
    filler = FILLERS[words]
    if args.workload in ("chat", "chat-sessions"):
        reqs = synthetic_chat(session_header=args.workload == "chat-sessions", model=model, filler=filler)
    elif args.workload == "pressure":
        arrivals = pressure.from_args(args, filler)
        reqs = [_chat_request(i, t, m, n, model) for i, (t, m, n) in enumerate(arrivals)]
    elif args.workload == "reuse":
        reqs = reuse_rich(reuse=args.reuse, rate=args.rate, model=model, filler=filler)
    else:
        reqs = mixed(model=model, filler=filler)
    return _bounded(reqs, args)


def scaled(trace: list[BenchRequest], words: str, block: int) -> list[BenchRequest]:
    """Trace requests written in ``words``, each hash id standing for ``block`` tokens (prompts
    shorter or longer in proportion, the same prefixes shared)."""
    if words == "filler" and block == TRACE_BLOCK_TOKENS:
        return trace

    def tokens(r: BenchRequest) -> int:
        return max(1, -(-r.prompt_tokens * block // TRACE_BLOCK_TOKENS))

    return [replace(r, words=words, block_tokens=block, prompt_tokens=tokens(r)) for r in trace]


def _bounded(reqs: list[BenchRequest], args: argparse.Namespace) -> list[BenchRequest]:
    """``--max-context`` (requests longer than a server takes left out, renumbered), then ``--limit``."""
    reqs = within(reqs, getattr(args, "max_context", None))
    return reqs[: args.limit] if args.limit else reqs


def within(reqs: list[BenchRequest], most: int | None) -> list[BenchRequest]:
    """The requests whose prompt plus answer fit ``most`` tokens (None: all), renumbered."""
    kept = [r for r in reqs if r.prompt_tokens + r.output_tokens <= most] if most else reqs
    return [replace(r, rid=i) for i, r in enumerate(kept)] if most else reqs
