"""Every vLLM route a fleet uses, end to end: the official openai client -> real Nginx with the
project's Lua -> real sidecar and Redis -> simulated vLLM backends, which keep Responses in their own
memory (a follow-up sent to another backend is a 404), as vLLM does."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import openai
import pytest
from kvgate.tools.launcher import Supervisor

from tests.conftest import MODEL, http_json
from tests.e2e.test_gateway import Env, client, post, raw_post

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    stack = Supervisor(tmp_path_factory.mktemp("routes") / "run")
    try:
        yield Env(stack, replicas=2)
    finally:
        stack.stop_all()


def test_a_responses_conversation_follows_its_backend_across_replicas(env: Env) -> None:
    """Each turn's previous_response_id names a response only one backend holds: every turn must
    land there, whichever gateway replica takes it (the binding lives in Redis)."""
    for conversation in range(6):
        previous = None
        backend = None
        for turn in range(4):
            gw = env.gateways[turn % 2]
            c = client(gw.url)
            raw = c.responses.with_raw_response.create(
                model=MODEL,
                input=f"conversation {conversation} turn {turn} " + "words " * 40,
                previous_response_id=previous,
                max_output_tokens=4,
            )
            r = raw.parse()
            assert r.status in ("completed", "incomplete")
            here = raw.headers["X-Kvgate-Backend"]
            assert backend in (None, here), f"turn {turn} moved from {backend} to {here}"
            backend, previous = here, r.id
        got = client(env.gateways[1].url).responses.retrieve(previous)
        assert got.id == previous


def test_a_streamed_response_binds_its_id_too(env: Env) -> None:
    c = client(env.gw.url)
    events = list(c.responses.create(model=MODEL, input="stream " * 30, max_output_tokens=3, stream=True))
    rid = events[-1].response.id
    follow = c.responses.with_raw_response.create(
        model=MODEL, input="next", previous_response_id=rid, max_output_tokens=2
    )
    assert follow.parse().previous_response_id == rid


def test_embeddings_score_rerank_tokenize_and_audio_pass_through(env: Env) -> None:
    c = client(env.gw.url)
    emb = c.embeddings.create(model=MODEL, input=["a b c", "a b c"])
    assert emb.data[0].embedding == emb.data[1].embedding
    for path, body in (
        ("/v1/score", {"model": MODEL, "text_1": "q", "text_2": ["a", "b"]}),
        ("/score", {"model": MODEL, "text_1": "q", "text_2": "a"}),
        ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b"]}),
        ("/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}),
        ("/tokenize", {"model": MODEL, "prompt": "one two three"}),
    ):
        r = post(env.gw.url, body, path=path)
        assert r.status_code == 200, (path, r.text)
        assert r.headers["X-Kvgate-Backend"].startswith("sim-")
    assert (
        post(env.gw.url, {"model": MODEL, "prompt": "one two three"}, path="/tokenize").json()["count"] == 3
    )
    out = c.audio.transcriptions.create(model=MODEL, file=("a.wav", b"\0" * 2000))
    assert len(out.text.split()) == 16


def test_a_backend_error_on_another_route_passes_through(env: Env) -> None:
    r = post(
        env.gw.url,
        {"model": MODEL, "input": "x", "previous_response_id": "resp_unknown"},
        path="/v1/responses",
    )
    assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
    r = post(env.gw.url, {"model": "no-such-model", "input": "x"}, path="/v1/embeddings")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_health_answers_like_vllm(env: Env) -> None:
    status, body = http_json("GET", env.gw.url + "/health")
    assert status == 200 and body in ("", None)


def test_every_status_nginx_makes_is_json(env: Env) -> None:
    """Statuses Nginx answers itself, provoked for real: each an OpenAI-style JSON error."""
    host, port = "127.0.0.1", int(env.gw.url.rsplit(":", 1)[1])

    def raw(request: bytes) -> tuple[int, bytes]:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(request)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            out = b""
            while body:
                size, _, rest = body.partition(b"\r\n")
                n = int(size, 16)
                if n == 0:
                    break
                out, body = out + rest[:n], rest[n + 2 :]
            body = out
        return int(head.split()[1]), body

    cases = [
        (400, b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n"),  # two Host headers
        (404, b"GET /nothing-here HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"),
        (405, b"DELETE /v1/models HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"),
        (
            413,
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999\r\nConnection: close\r\n\r\n",
        ),
        (414, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"),
        # Headers too large: Nginx's 494, which it sends as 400.
        (400, b"GET / HTTP/1.1\r\nHost: a\r\nX-Big: " + b"b" * 70000 + b"\r\nConnection: close\r\n\r\n"),
        (505, b"GET / HTTP/2.5\r\nHost: a\r\nConnection: close\r\n\r\n"),
    ]
    for expected, request in cases:
        status, body = raw(request)
        assert status == expected, (expected, status, body[:200])
        assert body.lstrip().startswith(b"{") and b'"error"' in body, (expected, body[:200])


def test_unknown_v1_routes_reach_a_backend(env: Env) -> None:
    """An unknown /v1/ route goes to a backend serving the model (vLLM answers its own 404 JSON)."""
    r = raw_post(env.gw.url + "/v1/some/new/route", b'{"model": "%s"}' % MODEL.encode())
    assert r.status_code == 404 and r.headers["X-Kvgate-Backend"].startswith("sim-")
    assert r.json() == {"detail": "Not Found"}
    with pytest.raises(openai.NotFoundError):
        client(env.gw.url).models.retrieve("no-such-model")


def test_the_gateways_model_list_carries_the_backends_own_cards(env: Env) -> None:
    """/v1/models through the gateway: each model's card as a backend gave it (vLLM's has root,
    max_model_len and created, which clients read), not a card of the gateway's making."""
    status, through = http_json("GET", env.gw.url + "/v1/models")
    direct = http_json("GET", f"http://127.0.0.1:{env.sim_port}/v1/models")[1]
    assert status == 200 and [m["id"] for m in through["data"]] == [MODEL]
    card, own = through["data"][0], direct["data"][0]
    for field in ("id", "object", "owned_by", "root", "max_model_len", "created"):
        assert card[field] == own[field], field
