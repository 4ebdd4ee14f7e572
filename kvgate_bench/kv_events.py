"""A simulated engine's KV events as kvgate's sidecar decodes them from a publisher's message (the
virtual replay hands them over in process, with no ZMQ in between)."""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.public import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

from vllm_sim.kv_cache import Cleared, KvEvent, Removed, Stored


def kv_batch(events: Sequence[KvEvent]) -> EventBatch:
    """One engine step's events, as one message's batch."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for ev in events:
        if isinstance(ev, Stored):
            out.append(BlockStored(ev.hashes, ev.parent, ev.block_size))
        elif isinstance(ev, Removed):
            out.append(BlockRemoved(ev.hashes))
        elif isinstance(ev, Cleared):
            out.append(AllBlocksCleared())
    return EventBatch(0.0, tuple(out), 0)
