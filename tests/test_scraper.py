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
    from kvgate.policies import NodeView, Snapshot
    from kvgate.ring import Ring

    s = Scraped(1.0, 0.0, 0.1, None, None, at=0.0)
    nodes = {"a": NodeView("a", 1.0, view(s, now=0.1, stale_after=2.0, unknown_requests=0))}
    assert Snapshot(nodes, Ring({"a": 1.0}), inflight={"a": 5}, inflight_tokens={"a": 100}).requests("a") == 5
