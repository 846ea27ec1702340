"""KV transports behind one small interface: TCP (pyzmq) and NIXL (UCX)."""

from __future__ import annotations
