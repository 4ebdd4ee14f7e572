"""Two gateway replicas over one Redis: each sees what the other has in flight (``kvgate.shared_load``),
and both views come back to zero when the request ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from kvgate.tools.launcher import Supervisor

from tests.conftest import MODEL
from tests.e2e.test_gateway import Env, client
from tests.helpers import Gateway

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    stack = Supervisor(tmp_path_factory.mktemp("replicas") / "run")
    try:
        yield Env(stack, replicas=2)
    finally:
        stack.stop_all()


def counts(gw: Gateway) -> tuple[int, int]:
    """(this replica's requests in flight, the other replicas' as it last read them), fleet-wide."""
    backends = gw.sidecar.backends().values()
    return sum(b["inflight"] for b in backends), sum(b["inflight_other_replicas"] for b in backends)


def kv(gw: Gateway) -> tuple[int, int]:
    """The same for the KV cache tokens those requests may take."""
    backends = gw.sidecar.backends().values()
    return (
        sum(b["inflight_kv_tokens"] for b in backends),
        sum(b["inflight_kv_tokens_other_replicas"] for b in backends),
    )


def wait_until(check: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def test_a_stream_through_one_replica_counts_on_the_other_and_ends_at_zero(env: Env) -> None:
    gw0, gw1 = env.gateways
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            chunks = client(gw0.url).completions.create(
                model=MODEL,
                prompt="long " * 500,
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in chunks:
                pass
        except BaseException as exc:  # reported by the test's own thread
            errors.append(exc)

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert wait_until(lambda: counts(gw1) == (0, 1), 3.0), counts(gw1)
        assert counts(gw0)[0] == 1
        # Its KV (what it prefills there, and its 400 tokens of output) reaches the other replica too.
        assert wait_until(lambda: kv(gw1)[1] == kv(gw0)[0] >= 400, 3.0), (kv(gw0), kv(gw1))
    finally:
        t.join(30)
    assert not errors and not t.is_alive()
    assert wait_until(lambda: counts(gw0) == counts(gw1) == kv(gw0) == kv(gw1) == (0, 0), 3.0), (
        counts(gw0),
        counts(gw1),
        kv(gw0),
        kv(gw1),
    )
