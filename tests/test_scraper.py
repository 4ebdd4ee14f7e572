from typing import Any

import pytest
from kvgate.load import Scraped, view
from kvgate.scraper import ScrapeError, parse_metrics

NEW = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40.0
python_gc_objects_collected_total{generation="0"} 5.0
"""

OLD = """vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10
vllm:gpu_prefix_cache_hits_total{model_name="m"} 5
"""


# SGLang with --enable-metrics, in the shape of its production-metrics documentation.
SGLANG = """# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0075
sglang:time_to_first_token_seconds_bucket{le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 162.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2826.0
"""


def test_reads_sglangs_names() -> None:
    s = parse_metrics(SGLANG, 1.0)
    assert (s.running, s.waiting, s.kv_usage, s.prompt_tokens) == (162, 2826, 0.28, 8.128902e6)
    assert s.prefix_queries is None and s.prefix_hits is None  # SGLang exposes no such counters


def test_a_backend_without_metrics_is_scraped_for_health_only() -> None:
    """metrics: none: any OpenAI-compatible server with a /health is routable, its load the
    sidecar's own in-flight counts; auto finds that it has no /metrics route and does the same; with
    vLLM metrics required, the same server fails its scrape."""
    import asyncio

    import aiohttp
    from aiohttp import web
    from kvgate.scraper import scrape

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                got = await scrape(session, f"http://127.0.0.1:{port}", 1.0, "none")
                assert (got.running, got.waiting, got.kv_usage) == (0.0, 0.0, None)
                auto = await scrape(session, f"http://127.0.0.1:{port}", 1.0, "auto")
                assert auto.metrics_less and (auto.running, auto.waiting) == (0.0, 0.0)
                with pytest.raises(ScrapeError, match="/metrics answered 404"):
                    await scrape(session, f"http://127.0.0.1:{port}", 1.0, "vllm")
            await asyncio.sleep(0.05)  # the closed session's connections finish closing in this loop
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_reads_new_names_first_whatever_the_label_order() -> None:
    s = parse_metrics(NEW, 1.0)
    assert (s.running, s.waiting, s.kv_usage, s.prefix_queries, s.prefix_hits) == (3, 2, 0.5, 100, 40)


def test_falls_back_to_the_old_names() -> None:
    s = parse_metrics(OLD, 1.0)
    assert (s.running, s.kv_usage, s.prefix_queries, s.prefix_hits) == (1, 0.25, 10, 5)


def test_sums_engines_and_tolerates_missing_kv() -> None:
    s = parse_metrics('vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n', 0)
    assert s.running == 3 and s.waiting == 0 and s.kv_usage is None


@pytest.mark.parametrize("text", ["\x00\xffnot{prometheus text\n", "", "other_metric 1\n"])
def test_garbage_or_foreign_metrics_are_a_scrape_error(text: str) -> None:
    with pytest.raises(ScrapeError):
        parse_metrics(text, 0)


def test_stale_stats_are_unknown_not_zero() -> None:
    s = Scraped(0.0, 0.0, 0.1, None, None, at=0.0)
    fresh = view(s, now=1.0, stale_after=2.0, unknown_requests=7.0)
    stale = view(s, now=3.0, stale_after=2.0, unknown_requests=7.0)
    assert fresh.known and fresh.requests == 0.0
    assert not stale.known and stale.requests == 7.0
    assert not stale.saturated(1, 0.5), "unknown load must not count as saturation"


def test_inflight_counts_between_scrapes() -> None:
    from kvgate.ring import Ring
    from kvgate.snapshot import NodeView, Snapshot

    s = Scraped(1.0, 0.0, 0.1, None, None, at=0.0)
    nodes = {"a": NodeView("a", 1.0, view(s, now=0.1, stale_after=2.0, unknown_requests=0))}
    assert Snapshot(nodes, Ring({"a": 1.0}), inflight={"a": 5}, inflight_tokens={"a": 100}).requests("a") == 5


def _reference(text: str) -> dict[str, float]:
    """What prometheus_client's full parser reads for the series the sidecar uses."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
    }
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in wanted:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_the_line_scanner_reads_what_prometheus_clients_parser_reads() -> None:
    """On a whole exposition of the simulator (histograms, _created series, HELP/TYPE lines, both
    name generations) and on label values holding braces, quotes and spaces."""
    from vllm_sim.engine import Engine
    from vllm_sim.metrics import InstanceMetrics
    from vllm_sim.profiles import LLAMA3_8B_H100
    from vllm_sim.request import EngineConfig, Request

    engine = Engine(EngineConfig.from_profile(LLAMA3_8B_H100))
    for i in range(5):
        engine.add_request(Request(f"r{i}", list(range(100 * (i + 1))), 8, 0.0))
    for step in range(3):
        engine.step(step * 0.01)
    metrics = InstanceMetrics(engine, 'model "x" {with} braces', lambda: (0.0, 0.0, 0.0))
    text = metrics.render().decode()
    ref = _reference(text)
    s = parse_metrics(text, 0.0)
    assert s.running == ref["vllm:num_requests_running"] and s.waiting == ref["vllm:num_requests_waiting"]
    assert s.kv_usage == ref["vllm:kv_cache_usage_perc"]
    assert s.prefix_queries == ref["vllm:prefix_cache_queries_total"]
    assert s.prefix_hits == ref["vllm:prefix_cache_hits_total"]
    assert s.running + s.waiting == 5
    tricky = 'vllm:num_requests_running{model_name="a} b\\" c",engine="0"} 7 1700000000000\n'
    assert _reference(tricky)["vllm:num_requests_running"] == parse_metrics(tricky, 0.0).running == 7


def test_the_line_scanner_costs_a_fraction_of_the_full_parser() -> None:
    """Not a timing budget: the scanner parses a handful of lines where the full parser parses all."""
    import cProfile
    import pstats

    from prometheus_client.parser import text_string_to_metric_families

    from vllm_sim.engine import Engine
    from vllm_sim.metrics import InstanceMetrics
    from vllm_sim.profiles import LLAMA3_8B_H100
    from vllm_sim.request import EngineConfig

    text = (
        InstanceMetrics(Engine(EngineConfig.from_profile(LLAMA3_8B_H100)), "m", lambda: (0, 0, 0))
        .render()
        .decode()
    )

    def calls(fn: object) -> int:
        prof = cProfile.Profile()
        prof.runcall(fn)  # type: ignore[arg-type]
        return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]

    scanner = calls(lambda: parse_metrics(text, 0.0))
    full = calls(lambda: list(text_string_to_metric_families(text)))
    assert scanner * 10 < full, (scanner, full)


def test_health_falls_back_to_models_only_where_there_is_no_health_route() -> None:
    """A server without /health is up when /v1/models answers; a /health that answers 503 is down
    whatever /v1/models says; a /metrics that answers garbage is a failed scrape even in auto."""
    import asyncio

    import aiohttp
    from aiohttp import web
    from kvgate.scraper import LoadUnknown, Unhealthy, scrape

    state = {"health": 404, "metrics": 404}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=state["health"])

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(status=state["metrics"], text="<html>not metrics</html>")

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                assert (await scrape(session, url, 1.0, "auto")).metrics_less
                state["health"] = 503
                with pytest.raises(Unhealthy, match="/health answered 503"):
                    await scrape(session, url, 1.0, "auto")
                state["health"], state["metrics"] = 200, 200
                with pytest.raises(LoadUnknown, match="no request gauges"):
                    await scrape(session, url, 1.0, "auto")
            await asyncio.sleep(0.05)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_slow_or_broken_metrics_route_is_unknown_load_and_a_slow_health_a_timeout() -> None:
    """What a scrape tells apart: metrics that time out or make no sense leave a healthy backend
    with unknown load (LoadUnknown); a /health that does not answer in time is Unhealthy with
    ``timeout`` (a busy or hung server: the registry weighs it); refused or 503 is Unhealthy, no
    timeout."""
    import asyncio

    import aiohttp
    from aiohttp import web
    from kvgate.scraper import LoadUnknown, Unhealthy, scrape

    from vllm_sim.engine import Engine
    from vllm_sim.metrics import InstanceMetrics
    from vllm_sim.profiles import LLAMA3_8B_H100
    from vllm_sim.request import EngineConfig

    good = InstanceMetrics(Engine(EngineConfig.from_profile(LLAMA3_8B_H100)), "m", lambda: (0, 0, 0)).render()
    state: dict[str, Any] = {"health_delay": 0.0, "health": 200, "metrics_delay": 0.0, "metrics": good}

    async def health(request: web.Request) -> web.Response:
        await asyncio.sleep(state["health_delay"])
        return web.Response(status=state["health"])

    async def metrics(request: web.Request) -> web.Response:
        await asyncio.sleep(state["metrics_delay"])
        return web.Response(body=state["metrics"], content_type="text/plain")

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                assert (await scrape(session, url, 0.2)).running == 0
                state["metrics_delay"] = 0.5
                with pytest.raises(LoadUnknown, match="no answer within 200 ms"):
                    await scrape(session, url, 0.2)
                state["metrics_delay"], state["metrics"] = 0.0, b"vllm:num_requests_running{ 7\n"
                with pytest.raises(LoadUnknown, match="unterminated labels"):
                    await scrape(session, url, 0.2)
                state["health_delay"] = 0.5
                with pytest.raises(Unhealthy) as slow:
                    await scrape(session, url, 0.2)
                assert slow.value.timeout
                state["health_delay"], state["health"] = 0.0, 503
                with pytest.raises(Unhealthy) as down:
                    await scrape(session, url, 0.2)
                assert not down.value.timeout
            await runner.cleanup()
            async with aiohttp.ClientSession() as session:
                with pytest.raises(Unhealthy) as refused:
                    await scrape(session, url, 0.2)
                assert not refused.value.timeout
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
