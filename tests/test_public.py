"""What code outside the runtime may use of it: every public name resolves to the runtime's own."""

import asyncio
import time

import kvgate.public as public
from kvgate.config import Config
from kvgate.nginx_conf import NginxSettings


def test_every_public_name_exists_and_is_the_runtimes_object() -> None:
    for name in public.__all__:
        assert getattr(public, name) is not None, name
    assert public.Config is Config and public.NginxSettings is NginxSettings
    assert sorted(public.__all__) == sorted(set(public.__all__))


def test_the_routing_core_decides_through_public_names_alone() -> None:
    """What the benchmark does: a core over one backend, its load and models set, one decision."""
    config = public.Config.from_mapping(
        {"redis": {"url": None}, "backends": [{"id": "b0", "url": "http://h:1"}]}
    )
    sc = public.build_sidecar(config, None)
    sc.registry.set_membership((b, False) for b in config.backends)
    sc.registry.set_models("b0", frozenset({"m"}))
    sc.registry.scrape_ok("b0", public.Scraped(0, 0, 0.1, None, None, time.monotonic()))
    sc.registry.changed()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    routed = asyncio.run(sc.service.decide(public.extract(body, None), "d1"))
    assert isinstance(routed, public.Routed) and routed.candidates[0].id == "b0"
