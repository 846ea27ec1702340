"""DisaggTierConnector's own logic: the order check and the KV-event pass-through (run for real, with LMCache
beneath two vLLM instances, in tests/e2e/test_lmcache_tier.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockStored, KVConnectorKVEvents, KVEventAggregator  # noqa: E402

from vllm_disagg.connectors.tiered import DisaggTierConnector, check_order  # noqa: E402

DISAGG = {"kv_connector": "DisaggConnector", "kv_role": "kv_both"}
TIER = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"}


def test_disagg_connector_must_come_first() -> None:
    check_order([DISAGG, TIER])
    with pytest.raises(ValueError, match="must be the first .* Move it to the front"):
        check_order([TIER, DISAGG])
    with pytest.raises(ValueError, match="no DisaggConnector"):
        check_order([TIER])
    with pytest.raises(ValueError, match="non-empty list"):
        check_order(None)


class _Events(KVConnectorKVEvents):
    """A minimal event container, as a tier connector's worker side returns one per step."""

    def __init__(self, events: list[Any]) -> None:
        self._agg = KVEventAggregator(1)
        self._agg.add_events(events)

    def add_events(self, events: list[Any]) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> KVConnectorKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list[Any]:
        return list(self._agg.get_all_events())

    def get_number_of_workers(self) -> int:
        return int(self._agg.get_number_of_workers())

    def clear_events(self) -> None:
        self._agg.clear_events()


class _Sub:
    def __init__(self, events: KVConnectorKVEvents | None) -> None:
        self.events = events

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self.events


def _stored(h: int) -> BlockStored:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=list(range(4)),
        block_size=4,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )


def test_sub_connector_events_are_passed_through() -> None:
    """vLLM's MultiConnector returns None here, dropping the tier's events; ours merges what each sub-connector made."""
    conn = object.__new__(DisaggTierConnector)  # the merge needs only the sub-connectors
    conn._connectors = [_Sub(None), _Sub(_Events([_stored(1)])), _Sub(None), _Sub(_Events([_stored(2)]))]  # type: ignore[list-item]
    merged = conn.get_kv_connector_kv_cache_events()
    assert isinstance(merged, _Events)
    assert [e.block_hashes for e in merged.get_all_events()] == [[1], [2]]
    conn._connectors = [_Sub(None)]  # type: ignore[list-item]
    assert conn.get_kv_connector_kv_cache_events() is None
