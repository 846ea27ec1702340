"""Byte-level access to one instance's paged KV cache, one whole block of one layer at a time.

Blocks move whole and verbatim (the CPU attention kernels lay K out transposed or tiled inside a block), so the
transfer engine needs only "the bytes of block b of layer l", as a zero-copy view for sending and a destination
for receiving. The connector builds a store from vLLM's KV tensors; unit tests build one from numpy arrays.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class BlockStore(Protocol):
    num_layers: int
    block_bytes: int
    num_blocks: int

    def read(self, layer: int, block_id: int) -> memoryview:
        """A zero-copy view of one block of one layer (valid while the block is held)."""
        ...

    def write(self, layer: int, block_id: int, data: memoryview | bytes) -> None:
        """Overwrite one block of one layer with ``block_bytes`` bytes."""
        ...


class HostBlockStore:
    """KV cache in host memory: one uint8 array ``[num_blocks, block_bytes]`` per layer, viewing the real cache."""

    def __init__(self, layers: list[np.ndarray]) -> None:
        if not layers:
            raise ValueError("no KV cache layers")
        shapes = {a.shape for a in layers}
        if len(shapes) != 1 or layers[0].ndim != 2 or layers[0].dtype != np.uint8:
            raise ValueError(f"expected equal uint8 [num_blocks, block_bytes] arrays, got shapes {shapes}")
        for a in layers:
            if not a.flags["C_CONTIGUOUS"]:
                raise ValueError("KV cache layer arrays must be C-contiguous")
        self.layers = layers
        self.num_layers = len(layers)
        self.num_blocks, self.block_bytes = layers[0].shape

    @property
    def layer_addrs(self) -> list[int]:
        """Base address of each layer's region (for registering the cache with NIXL once)."""
        return [int(a.ctypes.data) for a in self.layers]

    @property
    def layer_bytes(self) -> int:
        return int(self.layers[0].nbytes)

    def read(self, layer: int, block_id: int) -> memoryview:
        return memoryview(self.layers[layer][block_id])

    def write(self, layer: int, block_id: int, data: memoryview | bytes) -> None:
        self.layers[layer][block_id] = np.frombuffer(data, dtype=np.uint8)
