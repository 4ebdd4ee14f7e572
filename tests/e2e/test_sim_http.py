"""The simulator over real HTTP with the official openai client (one vllm-sim process per module)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from kvgate.tools.launcher import Supervisor
from kvgate.tools.readiness import free_ports

from tests.conftest import MODEL, http_json, require_binary, wait_until


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    s = Supervisor(tmp_path_factory.mktemp("sim"))
    port = free_ports(2)
    s.start_sim(port, 2, "sim", "--model", MODEL, "--max-model-len", "8192", "--seed", "1")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        s.stop_all()


@pytest.fixture
def client(sim: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim + "/v1", api_key="unused", max_retries=0, timeout=30)


def words(n: int, key: str = "x") -> str:
    return " ".join(f"{key}{i}" for i in range(n))


def test_chat_non_streaming_shape_and_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": words(10, "a")}],
        max_tokens=7,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].message.content.split()) == 7
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 10 + 3 and r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_role_chunk_tokens_usage_and_done(client: openai.OpenAI, sim: str) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": words(20, "b")}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = [c for c in chunks[1:] if c.choices]
    assert len(content) == 5 and content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    # The raw stream ends with [DONE].
    req = urllib.request.Request(
        sim + "/v1/completions",
        method="POST",
        headers={"Content-Type": "application/json"},
        data=b'{"prompt": "hello world", "max_tokens": 3, "stream": true}',
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        raw = resp.read().decode()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 4


def test_sim_info_shows_the_prefill_backlog_while_a_long_prompt_prefills(
    client: openai.OpenAI, sim: str
) -> None:
    """``/sim/info`` (simulator-only, for benchmarks checking a router's load view): a prompt is
    backlog until its first token; idle, everything is zero."""
    import threading

    done = threading.Event()

    def send() -> None:
        client.completions.create(model=MODEL, prompt=words(6000, "info"), max_tokens=2)
        done.set()

    seen: list[dict[str, int]] = []
    t = threading.Thread(target=send)
    t.start()
    while not done.is_set():
        seen.append(http_json("GET", sim + "/sim/info")[1])
        time.sleep(0.005)
    t.join()
    assert max(s["prefill_backlog_running"] + s["prefill_backlog_waiting"] for s in seen) > 1000
    idle = http_json("GET", sim + "/sim/info")[1]
    assert (idle["frontend"], idle["running"], idle["waiting"]) == (0, 0, 0)
    assert idle["prefill_backlog_running"] == idle["prefill_backlog_waiting"] == 0


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt=words(30, "c"), max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and len(r.choices[0].text.split()) == 4
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=words(30, "c"), max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_repeated_prompt_reports_cached_tokens_faster_ttft_and_metrics(
    client: openai.OpenAI, sim: str
) -> None:
    prompt = words(4000, "d")  # 4,000 tokens exactly (completions add no template)

    def ttft() -> tuple[float, int]:
        t0 = time.perf_counter()
        stream = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first = None
        cached = -1
        for c in stream:
            if first is None and c.choices:
                first = time.perf_counter() - t0
            if c.usage is not None:
                cached = c.usage.prompt_tokens_details.cached_tokens
        assert first is not None
        return first, cached

    def hits() -> float:
        text = urllib.request.urlopen(sim + "/metrics", timeout=5).read().decode()
        line = next(x for x in text.splitlines() if x.startswith("vllm:prefix_cache_hits_total"))
        return float(line.rsplit(" ", 1)[1])

    before = hits()
    cold, cached0 = ttft()
    warm, cached1 = ttft()
    assert cached0 == 0 and cached1 == 3984
    assert hits() - before == 3984
    # The profile predicts 3,984 x 0.0325 ms = 129 ms less prefill; wall clock adds noise.
    assert 0.08 < cold - warm < 0.2, (cold, warm)


def counter(sim: str, name: str) -> float:
    """The sum of one series of the simulator's /metrics over its label sets."""
    text = urllib.request.urlopen(sim + "/metrics", timeout=5).read().decode()
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))


def test_n_completions_are_engine_requests_of_their_own_that_share_the_prompts_blocks(
    client: openai.OpenAI, sim: str
) -> None:
    """As vLLM 0.32 serves ``n`` (tests/real/test_twin.py compares the counters): n engine
    requests, each counted; the prompt's full blocks are cached when the first is scheduled, so
    the others hit them in the same step; usage counts the prompt once, every completion's tokens,
    and the prompt's hit. A stream sends each completion's role, then tokens by index. A completions
    batch is n completions of each of its prompts."""
    names = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total")
    before = {name: counter(sim, name) for name in names}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": words(600, "n")}], max_tokens=5, n=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = r.usage.prompt_tokens
    whole = (prompt - 1) // 16 * 16
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15 and r.usage.prompt_tokens_details.cached_tokens == whole
    grew = {name: counter(sim, name) - before[name] for name in names}
    assert grew == {names[0]: 3, names[1]: 3 * prompt, names[2]: 2 * whole}, (grew, prompt)

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": words(50, "m")}], max_tokens=4, n=2,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    tokens = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.content]
    finished = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert roles == [0, 1] and sorted(tokens) == [0] * 4 + [1] * 4 and sorted(finished) == [0, 1]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    # A completions batch: n completions of each prompt, each prompt counted once in usage
    before = counter(sim, names[0])
    status, body = http_json(
        "POST",
        sim + "/v1/completions",
        {"prompt": ["a b", [1, 2, 3]], "n": 2, "max_tokens": 3, "ignore_eos": True},
    )
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3], body
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (5, 12)
    assert counter(sim, names[0]) - before == 4
    for bad in (0, -1):
        status, body = http_json("POST", sim + "/v1/completions", {"prompt": "x", "n": bad})
        assert status == 400 and body["error"]["message"] == f"n must be at least 1, got {bad}.", body


def test_an_fcfs_server_takes_a_priority_and_counts_it_by_value(sim: str) -> None:
    """vLLM 0.32 on its default FCFS scheduler answers a request naming a priority as any other (it
    ignores the value); /sim/info counts the requests by the priority they carried, which is how
    the gateway's tests see what it forwarded."""
    before = http_json("GET", sim + "/sim/info")[1]["priorities"]
    for priority in (3, -5, 3):
        status, body = http_json(
            "POST", sim + "/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": priority}
        )
        assert status == 200, body
    assert http_json("POST", sim + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
    after = http_json("GET", sim + "/sim/info")[1]["priorities"]
    grew = {p: n - before.get(p, 0) for p, n in after.items() if n != before.get(p, 0)}
    assert grew == {"3": 2, "-5": 1, "0": 1}


def test_errors_use_vllm_envelope(sim: str) -> None:
    status, body = http_json(
        "POST",
        sim + "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    )
    assert status == 404 and body["error"]["type"] == "NotFoundError" and body["error"]["param"] == "model"
    status, body = http_json("POST", sim + "/v1/chat/completions", {"messages": "x"})
    assert status == 400 and body["error"]["code"] == 400
    status, body = http_json("POST", sim + "/v1/completions", {"prompt": words(9000), "max_tokens": 1})
    assert status == 400 and "maximum context length is 8192" in body["error"]["message"]
    status, body = http_json("POST", sim + "/v1/completions", {"prompt": "x", "priority": "x"})
    assert status == 400 and body["error"]["param"] == "body.priority"
    # as vLLM 0.32 answers them (tests/real/test_compute.py holds both to the same): the schema's
    # "Bad Request" with the field's place, or vLLM's own check
    for sent, want in (
        ({"prompt": "x", "temperature": -1}, ("BadRequestError", "temperature")),
        ({"prompt": []}, ("BadRequestError", None)),
        ({"prompt": [1, "a"]}, ("Bad Request", "body.prompt.1")),
        ({"prompt": 5}, ("Bad Request", "body.prompt")),
        ({"model": 5, "prompt": "x"}, ("Bad Request", "body.model")),
    ):
        status, body = http_json("POST", sim + "/v1/completions", sent)
        assert status == 400 and (body["error"]["type"], body["error"]["param"]) == want, (sent, body)
    status, body = http_json(
        "POST", sim + "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}
    )
    assert status == 400
    req = urllib.request.Request(
        sim + "/v1/completions",
        data=b"{not json",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400 and b"Traceback" not in err.value.read()
    err.value.close()


def test_unknown_fields_are_accepted(sim: str) -> None:
    status, body = http_json(
        "POST", sim + "/v1/completions", {"prompt": "x y", "max_tokens": 2, "frobnicate": 1}
    )
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


def test_side_endpoints(sim: str) -> None:
    assert http_json("GET", sim + "/v1/models")[1]["data"][0]["id"] == MODEL
    assert http_json("GET", sim + "/version")[1] == {"version": "0.11.0"}
    status, tok = http_json("POST", sim + "/tokenize", {"prompt": "one two three"})
    assert status == 200 and tok["count"] == 3 and tok["max_model_len"] == 8192
    with urllib.request.urlopen(sim + "/health", timeout=5) as resp:
        assert resp.status == 200 and resp.read() == b""
    assert http_json("GET", sim + "/server_info")[0] == 404  # vLLM outside dev mode


def test_metrics_pass_promtool_apart_from_vllms_colon_names(sim: str) -> None:
    promtool = require_binary("promtool")
    text = urllib.request.urlopen(sim + "/metrics", timeout=5).read()
    for name in (
        "vllm:num_requests_running{",
        "vllm:kv_cache_usage_perc{",
        "vllm:gpu_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:gpu_prefix_cache_hits_total{",
        "vllm:num_preemptions_total{",
        "vllm:request_success_total{",
        "vllm:cache_config_info{",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0"',
        "vllm_sim_step_lag_seconds{",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
    ):
        assert name.encode() in text, name
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    problems = [
        line
        for line in (out.stdout + out.stderr).decode().splitlines()
        # Real vLLM's names carry a colon; the simulator's own must follow Prometheus naming.
        if line.strip() and not (line.startswith("vllm:") and "should not contain ':'" in line)
    ]
    assert problems == []


def test_faults_unhealthy_fail_rate_and_garbage_metrics(sim: str) -> None:
    other = sim.rsplit(":", 1)[0] + ":" + str(int(sim.rsplit(":", 1)[1]) + 1)
    try:
        assert (
            http_json(
                "POST",
                other + "/sim/faults",
                {"unhealthy": True, "fail_rate": 1.0, "fail_status": 503, "metrics": "garbage"},
            )[0]
            == 200
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(other + "/health", timeout=5)
        assert err.value.code == 503
        err.value.close()
        status, body = http_json("POST", other + "/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert status == 503 and body["error"]["code"] == 503
        assert b"vllm:" not in urllib.request.urlopen(other + "/metrics", timeout=5).read()
        assert http_json("POST", other + "/sim/faults", {"bogus": 1})[0] == 400
    finally:
        http_json("DELETE", other + "/sim/faults")
    assert http_json("POST", other + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_fault_abort_after_tokens_cuts_the_stream(sim: str, client: openai.OpenAI) -> None:
    http_json("POST", sim + "/sim/faults", {"abort_after_tokens": 2})
    try:
        with pytest.raises(openai.APIConnectionError):  # the connection drops without [DONE]
            list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=10,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
    finally:
        http_json("DELETE", sim + "/sim/faults")


def test_fault_refuse_connections_then_recover(tmp_path: Path) -> None:
    s = Supervisor(tmp_path / "run")
    port = free_ports(1)
    try:
        s.start_sim(port, 1, "sim")
        url = f"http://127.0.0.1:{port}"
        assert http_json("POST", url + "/sim/faults", {"refuse_for_s": 1.0})[0] == 200

        def answers() -> bool:
            try:
                return http_json("GET", url + "/version", timeout=1)[0] == 200
            except OSError:
                return False

        wait_until(lambda: not answers(), timeout=2)  # refused within the first moments
        wait_until(answers, timeout=5)  # and back after the second
    finally:
        s.stop_all()


def test_fault_hang_accepts_and_never_answers(sim: str) -> None:
    other = sim.rsplit(":", 1)[0] + ":" + str(int(sim.rsplit(":", 1)[1]) + 1)
    http_json("POST", other + "/sim/faults", {"hang": True})
    try:
        body = b'{"prompt": "x", "max_tokens": 1}'
        with socket.create_connection(("127.0.0.1", int(other.rsplit(":", 1)[1])), timeout=0.5) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            with pytest.raises(TimeoutError):
                conn.recv(1)
    finally:
        http_json("DELETE", other + "/sim/faults")


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "a \\ud800 b", "max_tokens": 2}',  # a lone surrogate as a JSON escape
        b'{"prompt": "a \xed\xa0\x80 b", "max_tokens": 2}',  # the same as raw bytes
        b'{"prompt": "a b", "max_tokens": 2, "cache_salt": "\\udfff"}',
    ],
)
def test_lone_surrogates_in_a_prompt_do_not_take_the_server_down(sim: str, body: bytes) -> None:
    req = urllib.request.Request(
        sim + "/v1/completions", method="POST", headers={"Content-Type": "application/json"}, data=body
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
    except urllib.error.HTTPError as exc:
        assert exc.code == 400
        exc.close()
    assert http_json("GET", sim + "/health")[0] == 200


def _timed_post(url: str, body: dict[str, Any]) -> tuple[float, float, float]:
    """Seconds to the status line and headers, to the first body bytes, and to the end."""
    import http.client

    host, port = url.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=data, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    t_headers = time.perf_counter() - t0
    assert resp.status == 200
    resp.read1(1)
    t_first = time.perf_counter() - t0
    resp.read()
    t_end = time.perf_counter() - t0
    conn.close()
    return t_headers, t_first, t_end


def test_stream_headers_leave_at_acceptance_and_the_first_event_with_the_first_token(sim: str) -> None:
    """vLLM streams through a Starlette StreamingResponse: headers before prefill, the role chunk with
    the first token. A JSON response comes whole at the end (vLLM's JSONResponse)."""
    prompt = words(6000, "hdr")  # ~0.2 s of prefill on the H100 profile
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "stream": True,
    }
    t_headers, t_first, _ = _timed_post(sim, body)
    assert t_headers < 0.1 and t_first - t_headers > 0.1, (t_headers, t_first)
    body = {**body, "stream": False, "messages": [{"role": "user", "content": words(6000, "hdr2")}]}
    t_headers, t_first, t_end = _timed_post(sim, body)
    assert t_headers > 0.1 and t_end - t_headers < 0.05, (t_headers, t_end)


def _ttft_histogram(url: str) -> tuple[float, float]:
    """(sum, count) of the instance's ``vllm:time_to_first_token_seconds``."""
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for kind in found:
            if line.startswith(f"vllm:time_to_first_token_seconds_{kind}"):
                found[kind] += float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


def test_ttft_metric_is_the_first_tokens_time_never_more_than_the_client_saw(sim: str) -> None:
    """The histogram counts from the request's arrival to the step that produced its first token, so
    it can only be shorter than what the client measured (which adds HTTP and parsing). Stamped with
    the request's latest token time instead, it read one decode step late, above the client's."""
    s0, c0 = _ttft_histogram(sim)
    seen = []
    for i in range(3):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": words(3000, f"ttft{i}")}],
            "max_tokens": 8,
            "stream": True,
        }
        seen.append(_timed_post(sim, body)[1])
    s1, c1 = _ttft_histogram(sim)
    assert c1 - c0 == 3
    assert (s1 - s0) / 3 < sum(seen) / 3, (s1 - s0, seen)


def test_idle_client_connections_are_closed_after_the_keep_alive_time(tmp_path: Path) -> None:
    s = Supervisor(tmp_path / "run")
    port = free_ports(1)
    try:
        s.start_sim(port, 1, "sim", "--keep-alive-s", "0.5")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"200" in conn.recv(4096)
            t0 = time.perf_counter()
            assert conn.recv(4096) == b""  # the server closes the idle connection
            assert 0.3 < time.perf_counter() - t0 < 3
    finally:
        s.stop_all()


# -- vLLM's other routes ------------------------------------------------------------------------------
def test_responses_store_and_continue_only_where_they_were_made(client: openai.OpenAI, sim: str) -> None:
    """vLLM keeps a stored response in the instance's memory: previous_response_id continues it there
    (its turns come first in the new prompt, so the prefix cache serves them) and is a 404 elsewhere."""
    first = client.responses.create(model=MODEL, input=words(40, "resp"), max_output_tokens=8)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.output[0].content[0].type == "output_text" and first.usage.input_tokens > 40
    again = client.responses.create(
        model=MODEL, input="and then?", previous_response_id=first.id, max_output_tokens=4
    )
    assert again.previous_response_id == first.id
    assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert again.usage.input_tokens_details.cached_tokens >= 32  # the first turn's full blocks
    assert client.responses.retrieve(first.id).id == first.id
    host, _, port = sim.rpartition(":")
    other = openai.OpenAI(base_url=f"{host}:{int(port) + 1}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="not found"):
        other.responses.create(model=MODEL, input="x", previous_response_id=first.id)


def test_responses_stream_typed_events(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL, input=words(5, "rs"), max_output_tokens=3, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") == 3
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == 3


def test_embeddings_score_rerank_and_render(client: openai.OpenAI, sim: str) -> None:
    emb = client.embeddings.create(model=MODEL, input=["same text", "same text", "other"])
    vectors = [d.embedding for d in emb.data]
    assert vectors[0] == vectors[1] != vectors[2] and emb.usage.prompt_tokens == 5
    status, score = http_json(
        "POST", sim + "/v1/score", {"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}
    )
    assert status == 200 and [d["index"] for d in score["data"]] == [0, 1]
    status, rerank = http_json(
        "POST", sim + "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b", "c"], "top_n": 2}
    )
    scores = [r["relevance_score"] for r in rerank["results"]]
    assert status == 200 and len(scores) == 2 and scores == sorted(scores, reverse=True)
    status, render = http_json(
        "POST",
        sim + "/v1/chat/completions/render",
        {"model": MODEL, "messages": [{"role": "user", "content": "a b"}]},
    )
    assert status == 200 and len(render["token_ids"]) == 2 + 3
    status, err = http_json("POST", sim + "/v1/embeddings", {"model": "nope", "input": "x"})
    assert status == 404 and err["error"]["param"] == "model"


def test_audio_transcription_is_multipart(client: openai.OpenAI) -> None:
    out = client.audio.transcriptions.create(model=MODEL, file=("a.wav", b"\0" * 3000))
    assert len(out.text.split()) == 16


def test_disaggregated_prefill_then_decode_like_vllms_nixl_connector(tmp_path: Path) -> None:
    """A prefill instance answers a do_remote_decode leg with one token, finish "length" and the
    kv_transfer_params a decoder needs; a decode instance given them skips the prefill (TTFT is the
    KV transfer plus a step) and each role refuses the other's leg."""
    s = Supervisor(tmp_path)
    port = free_ports(3)
    s.start_sim(port, 3, "sim", "--model", MODEL, "--role", "prefill,decode,both", "--seed", "1")
    prefiller, decoder, both = (f"http://127.0.0.1:{port + i}" for i in range(3))
    try:
        prompt = words(6000, "pd")
        leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": leg}
        status, first = http_json("POST", prefiller + "/v1/completions", body)
        assert status == 200 and first["choices"][0]["finish_reason"] == "length"
        params = first["kv_transfer_params"]
        assert (
            params["do_remote_prefill"] is True
            and params["remote_num_tokens"] == first["usage"]["prompt_tokens"]
        )
        assert params["remote_port"] == port and params["remote_block_ids"]

        def ttft(url: str, extra: dict[str, Any]) -> float:
            t0 = time.perf_counter()
            req = urllib.request.Request(
                url + "/v1/completions",
                data=json.dumps(
                    {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True, **extra}
                ).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.readline()  # the first event: the first token
                took = time.perf_counter() - t0
                resp.read()
            return took

        remote = ttft(decoder, {"kv_transfer_params": params})
        local = ttft(both, {})  # the same prompt prefilled in place
        assert remote < local / 2, (remote, local)
        status, _ = http_json("POST", decoder + "/v1/completions", body)
        assert status == 400  # a decode instance does not prefill for others
        status, _ = http_json(
            "POST", prefiller + "/v1/completions", {**body, "max_tokens": 4, "kv_transfer_params": params}
        )
        assert status == 400  # nor the reverse
        status, _ = http_json(
            "POST", both + "/v1/completions", {**body, "kv_transfer_params": {"do_remote_prefill": True}}
        )
        assert status == 400  # a remote prefill without its blocks
    finally:
        s.stop_all()


def test_a_client_that_goes_away_mid_stream_is_an_abort_not_an_error(tmp_path: Path) -> None:
    """vLLM aborts the request of a client that disconnected and logs no error. Closed under a
    stream that is still writing, the connection fails the next write; that is the client's abort:
    the engine request ends and the log holds no traceback."""
    s = Supervisor(tmp_path / "run")
    port = free_ports(1)
    try:
        s.start_sim(port, 1, "sim", "--model", MODEL)
        url = f"http://127.0.0.1:{port}"
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": words(50, "gone"),
                "max_tokens": 400,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        for _ in range(3):
            conn = socket.create_connection(("127.0.0.1", port), timeout=5)
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            assert b"data: " in conn.recv(65536) or b"data: " in conn.recv(65536)
            conn.close()  # mid-stream: hundreds of tokens still to come
        # 400 tokens each take seconds; a client's disconnect ends its engine request at once
        wait_until(lambda: http_json("GET", url + "/sim/info")[1]["running"] == 0, timeout=1)
        assert http_json("GET", url + "/health")[0] == 200
        # ... and, as in vLLM, is not counted as a finished request of any reason
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            success = [
                ln for ln in r.read().decode().splitlines() if ln.startswith("vllm:request_success_total")
            ]
        assert success and all(ln.endswith(" 0.0") for ln in success), success
    finally:
        s.stop_all()
    log = (tmp_path / "run" / "sim.log").read_text()
    assert "Traceback" not in log and "Error handling request" not in log, log


def test_a_write_that_finds_the_connection_closed_ends_the_handler_as_a_disconnect() -> None:
    """The race the test above rarely hits: a stream's second write in one step, after the first
    found the connection reset, raises before aiohttp's handler cancellation arrives. The middleware
    makes it the cancellation aiohttp ignores quietly, not a 500 logged with a traceback."""
    from aiohttp.client_exceptions import ClientConnectionResetError
    from aiohttp.test_utils import make_mocked_request

    from vllm_sim.facts import InstanceConfig
    from vllm_sim.profiles import LLAMA3_8B_H100
    from vllm_sim.request import EngineConfig
    from vllm_sim.server import Instance

    inst = Instance(InstanceConfig(MODEL, EngineConfig.from_profile(LLAMA3_8B_H100)))

    async def handler(request: Any) -> Any:
        raise ClientConnectionResetError("Cannot write to closing transport")

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(inst._errors(make_mocked_request("POST", "/v1/chat/completions"), handler))
