"""What a transfer engine hands both of its sides: the prefill side (``Sender``) and the decode side (``Receiver``)
use the same block store, geometry, settings, side channel, data paths and reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_disagg.kv_layout import KVGeometry
from vllm_disagg.transport.block_store import BlockStore
from vllm_disagg.transport.channel import SideChannel
from vllm_disagg.transport.datapath import DataPath
from vllm_disagg.transport.records import Reports

if TYPE_CHECKING:
    from vllm_disagg.transport.engine import EngineSettings


@dataclass(frozen=True)
class EngineParts:
    """The parts of one transfer engine that its sender and receiver share (all used on the I/O thread)."""

    store: BlockStore
    geometry: KVGeometry
    engine_id: str
    settings: EngineSettings
    channel: SideChannel  # every send (tests wrap it to inject faults)
    paths: tuple[DataPath, ...]  # the data paths this engine opened, in preference order
    reports: Reports  # stats and per-transfer records


class EngineSide:
    """Base of ``Sender`` and ``Receiver``: the shared parts as attributes (data paths by name)."""

    def __init__(self, parts: EngineParts) -> None:
        self.store = parts.store
        self.geometry = parts.geometry
        self.engine_id = parts.engine_id
        self.settings = parts.settings
        self.channel = parts.channel
        self.paths = {p.name: p for p in parts.paths}
        self.reports = parts.reports
        self.stats = parts.reports.stats
