"""Moving KV blocks between instances: a side channel (ZMQ) plus pluggable data paths (TCP, NIXL).

``engine.TransferEngine`` is the entry point; ``datapath.DataPath`` is the interface a data path implements."""

from __future__ import annotations
