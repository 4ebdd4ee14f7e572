"""The KV-event decoder: both encodings vLLM has shipped, both hash types, and hostile payloads."""

import msgpack
import pytest
from kvgate.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    MalformedEvents,
    decode,
    seq_of,
)

DIGEST = bytes(range(32))
LOW64 = int.from_bytes(DIGEST[-8:], "big")


def test_maps_tagged_by_type_as_vllm_0_32_sends_them() -> None:
    payload = msgpack.packb(
        [
            1700000000.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [11, 12],
                    "parent_block_hash": None,
                    "token_ids": list(range(32)),
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": None,
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                },
                {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0},
                {"type": "AllBlocksCleared"},
            ],
            None,
        ]
    )
    batch = decode(payload)
    assert batch.ts == 1700000000.5 and batch.rank == 0 and batch.unknown == 0
    assert batch.events == (BlockStored((11, 12), None, 16), BlockRemoved((11,)), AllBlocksCleared())


def test_positional_arrays_as_older_vllm_sends_them_with_bytes_hashes_and_a_rank() -> None:
    payload = msgpack.packb(
        [
            2.0,
            [
                ["BlockStored", [DIGEST], DIGEST, [1] * 16, 16, None, "GPU"],
                ["BlockRemoved", [DIGEST], "GPU"],
                ["AllBlocksCleared"],
            ],
            3,
        ]
    )
    batch = decode(payload)
    assert batch.rank == 3
    assert batch.events == (BlockStored((LOW64,), LOW64, 16), BlockRemoved((LOW64,)), AllBlocksCleared())


def test_a_batch_as_a_map_and_an_unknown_event_type_are_read() -> None:
    payload = msgpack.packb(
        {
            "ts": 1.0,
            "events": [{"type": "BlockMoved", "x": 1}, {"type": "BlockRemoved", "block_hashes": [-1]}],
        }
    )
    batch = decode(payload)
    assert batch.unknown == 1
    assert batch.events == (BlockRemoved(((1 << 64) - 1,)),)  # a signed hash is its two's complement


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        msgpack.packb("text"),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", []]),
        msgpack.packb([1.0, "events"]),
        msgpack.packb([1.0, [["BlockStored", [1]]]]),  # fields missing
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 0}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": "abc"}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [True]}]]),
        msgpack.packb([1.0, [7]]),
        msgpack.packb([1.0, [], -1]),
    ],
)
def test_garbage_raises_malformed_and_nothing_else(payload: bytes) -> None:
    with pytest.raises(MalformedEvents):
        decode(payload)


def test_sequence_frames() -> None:
    assert seq_of((5).to_bytes(8, "big")) == 5
    assert seq_of((-1).to_bytes(8, "big", signed=True)) == -1  # the replay's end marker
    with pytest.raises(MalformedEvents):
        seq_of(b"\x00\x01")
