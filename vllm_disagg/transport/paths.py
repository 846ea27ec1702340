"""The data paths this build knows, in preference order: decode offers them in this order, and prefill takes the
first one it also has. A new data path is a module implementing ``datapath.DataPath`` plus its line here."""

from __future__ import annotations

from vllm_disagg.transport.datapath import PathFactory
from vllm_disagg.transport.nixl import NixlPath
from vllm_disagg.transport.tcp import TcpPath

FALLBACK = "tcp"  # opened even when ``transport`` names another path: every peer can receive over it

DATA_PATHS: dict[str, PathFactory] = {
    "nixl": NixlPath.open,
    "tcp": TcpPath.open,
}
