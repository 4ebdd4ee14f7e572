"""The snapshot a policy reads: room to dispatch (the replicas' split of the prefill budget, the
prompts that fit beside what waits), saturation and the bounded-load share, and the room of a
tenant past its share (prefill waiting, the reserve, the KV cache, the KV in flight)."""

from dataclasses import replace

from kvgate.config import LoadLimits
from kvgate.load import LoadView
from kvgate.ring import Ring
from kvgate.snapshot import NodeView, Snapshot


def load(requests: float = 0.0, waiting: float = 0.0, kv: float = 0.1, known: bool = True) -> LoadView:
    return LoadView(requests, kv, waiting, known)


def test_gateway_replicas_split_a_backends_prefill_budget_for_dispatch() -> None:
    """Room to dispatch from the gateway queue: one budget of prefill tokens per backend, shared by
    the replicas, so replicas that see a backend free up at once cannot pour two budgets into it."""
    nodes = {"a": NodeView("a", 1.0, load())}
    limits = LoadLimits(1.25, 8, 0.95, 1000)
    for replicas, tokens, room in ((1, 600, True), (2, 600, False), (2, 400, True), (1, 1000, False)):
        s = Snapshot(nodes, Ring({"a": 1.0}), limits, {"a": 1}, {"a": tokens}, replicas)
        assert s.has_room("a") is room, (replicas, tokens)
        assert s.saturated("a") is (tokens >= 1000)  # routing's own test ignores the split
    waiting = Snapshot({"a": NodeView("a", 1.0, load(waiting=9))}, Ring({"a": 1.0}), limits)
    assert not waiting.has_room("a")  # a backend queueing requests has no room, whatever the tokens


def test_a_backend_saturated_by_its_queue_is_admitted_where_the_queue_is_counted_but_not_out_of_kv() -> None:
    """``bound_admits(queued=True)``, for a placement whose expected first byte counts the queue: a
    backend queueing (requests waiting, or prefill tokens past the budget) is admitted, one at its KV
    mark or with requests waiting for free blocks is not, and the load bound still holds."""
    limits = LoadLimits(1.25, 1, 0.95, 1000)  # the gateway queue's: saturated at one waiting
    views = {
        "tokens": load(),
        "waiting": load(requests=1, waiting=1),
        "kv": load(kv=0.96),
        "blocks": replace(load(), kv_short=True),
        "idle": load(),
    }
    nodes = {n: NodeView(n, 1.0, v) for n, v in views.items()}
    s = Snapshot(nodes, Ring({n: 1.0 for n in nodes}), limits, {}, {"tokens": 2000})
    plain, queued = s.bound_admits(4.0), s.bound_admits(4.0, queued=True)
    assert [n for n in nodes if plain(n)] == ["blocks", "idle"]  # its waiting count says the rest
    assert [n for n in nodes if queued(n)] == ["tokens", "waiting", "idle"]
    assert [n for n in nodes if s.out_of_kv(n)] == ["kv", "blocks"]
    assert not s.bound_admits(1.0, queued=True)("waiting")  # over 1.0 x its share of 1 request


def test_a_prompt_fits_a_backend_alone_or_within_the_prefill_budget_beside_what_waits_there() -> None:
    """An engine packs the prefills waiting for it into one step and answers none of them before
    the step ends: beside prefill already waiting, a request has room only within the budget."""
    nodes = {"a": NodeView("a", 1.0, load()), "b": NodeView("b", 1.0, load())}
    limits = LoadLimits(1.25, 8, 0.95, 1000)
    s = Snapshot(nodes, Ring({"a": 1.0, "b": 1.0}), limits, {"a": 1}, {"a": 600})
    assert s.fits("a", 400) and not s.fits("a", 401)  # 600 waiting there: the budget is 1,000
    assert s.fits("b", 30_000)  # nothing waiting: a prompt of any length has the step to itself


def test_a_tenant_past_its_share_needs_little_prefill_waiting_and_another_backend_clear() -> None:
    """``room_past_share``: the node's prefill waiting under the budget, and ``reserve`` other nodes
    with none; a lone node cannot keep one clear, so only the budget applies to it."""
    limits = LoadLimits(1.25, 8, 0.95, 32_768)

    def room(tokens: dict[str, int], node: str, reserve: int = 1) -> bool:
        nodes = {n: NodeView(n, 1.0, load()) for n in tokens}
        s = Snapshot(nodes, Ring({n: 1.0 for n in tokens}), limits, {}, tokens)
        return s.room_past_share(node, 4_096, reserve)

    assert room({"a": 0, "b": 0}, "a")
    assert room({"a": 3_000, "b": 0}, "a")
    assert not room({"a": 5_000, "b": 0}, "a")  # over the budget, far under saturation
    assert not room({"a": 0, "b": 100}, "a")  # the other one is not clear
    assert room({"a": 0, "b": 100}, "a", reserve=0)
    assert room({"a": 0, "b": 100, "c": 0}, "a") and not room({"a": 0, "b": 100, "c": 0}, "a", reserve=2)
    assert room({"a": 1_000}, "a") and not room({"a": 5_000}, "a")


def test_a_tenant_past_its_share_leaves_kv_cache_free_on_its_backend_and_the_reserve() -> None:
    """``room_past_share`` with ``kv``: a flood's decodes fill every cache, and a request without KV
    blocks waits for some: the node and the backend kept clear must each have the cache to spare."""
    limits = LoadLimits(1.25, 8, 0.95, 32_768)

    def room(kv: dict[str, float], node: str, threshold: float = 0.85) -> bool:
        nodes = {n: NodeView(n, 1.0, load(kv=used)) for n, used in kv.items()}
        s = Snapshot(nodes, Ring({n: 1.0 for n in kv}), limits, {}, {n: 0 for n in kv})
        return s.room_past_share(node, 4_096, 1, threshold)

    assert room({"a": 0.5, "b": 0.5}, "a")
    assert not room({"a": 0.9, "b": 0.5}, "a")  # its own cache nearly full (not yet saturated)
    assert not room({"a": 0.5, "b": 0.9}, "a")  # the other one cannot be the reserve
    assert room({"a": 0.5, "b": 0.9, "c": 0.2}, "a")
    assert room({"a": 0.9, "b": 0.9}, "a", threshold=1.0)  # off


def test_a_tenant_past_its_share_counts_the_kv_its_requests_in_flight_may_take() -> None:
    """``kv_committed``: between scrapes, and as they decode after one, the requests in flight grow
    into the cache; the KV they may take (``inflight_kv``: uncached prompt and output) over the
    backend's cache (``LoadView.kv_tokens``) counts when it is more than the last scrape saw, for the node
    and the reserve. A backend that exports no cache size is read by its scrape alone."""
    limits = LoadLimits(1.25, 8, 0.95, 32_768)

    def snapshot(scraped: dict[str, float], held: dict[str, int], capacity: dict[str, int]) -> Snapshot:
        views = {n: replace(load(kv=used), kv_tokens=capacity.get(n, 0)) for n, used in scraped.items()}
        nodes = {n: NodeView(n, 1.0, v) for n, v in views.items()}
        zero = {n: 0 for n in scraped}
        return Snapshot(nodes, Ring(dict.fromkeys(scraped, 1.0)), limits, {}, zero, inflight_kv=held)

    cap = {"a": 10_000, "b": 10_000}
    s = snapshot({"a": 0.3, "b": 0.3}, {"a": 9_000}, cap)
    assert s.kv_committed("a") == 0.9 and s.kv_committed("b") == 0.3
    assert not s.room_past_share("a", 4_096, 1, 0.85)  # its requests will fill it
    assert not s.room_past_share("b", 4_096, 1, 0.85)  # a cannot be the reserve
    assert s.room_past_share("a", 4_096, 1, 1.0)  # off
    s = snapshot({"a": 0.6, "b": 0.3}, {"a": 1_000}, cap)
    assert s.kv_committed("a") == 0.6 and s.room_past_share("a", 4_096, 1, 0.85)  # the scrape says more
    unknown = snapshot({"a": 0.3, "b": 0.3}, {"a": 9_000}, {"b": 10_000})
    assert unknown.kv_committed("a") == 0.3 and unknown.room_past_share("b", 4_096, 1, 0.85)


def test_a_backend_holds_a_prompt_its_free_kv_blocks_can_take() -> None:
    """``holds``: the cache's free share at the last scrape against the tokens to prefill; a backend
    that exports no cache size holds anything; the KV in flight is not read (``kv_committed``)."""
    limits = LoadLimits(1.25, 8, 0.95, 32_768)
    views = {"a": replace(load(kv=0.75), kv_tokens=10_000), "b": load(kv=0.99)}
    nodes = {n: NodeView(n, 1.0, v) for n, v in views.items()}
    s = Snapshot(nodes, Ring(dict.fromkeys(views, 1.0)), limits, {}, {}, inflight_kv={"a": 9_000})
    assert s.holds("a", 2_500) and not s.holds("a", 2_501)
    assert s.holds("b", 100_000)
