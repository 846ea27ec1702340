"""KV-cache geometry, peer compatibility, and which blocks of a request become sendable in a step.

Pure logic, shared by the connector (both sides), the proxy (pair compatibility) and the planner (bytes/token).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
}


# Cache-dtype spellings vLLM stores as the same bytes: "fp8" is E4M3 wherever vLLM keeps an fp8 cache.
_SAME_CACHE_BYTES = {"fp8": "fp8_e4m3"}
_TENSOR_DTYPE_NAMES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}


def kv_dtype_tag(tensor_dtype: str, cache_dtype: str) -> str:
    """What a cache's stored bytes are, one tag per meaning so that equal bytes pair: the tensor's dtype alone when
    the cache holds the model's own type ("auto", or that type by name), else the tensor's dtype and the format."""
    cache = _SAME_CACHE_BYTES.get(cache_dtype, cache_dtype)
    if cache == "auto" or _TENSOR_DTYPE_NAMES.get(cache, cache) == tensor_dtype:
        return tensor_dtype
    return f"{tensor_dtype}/{cache}"


PAGE_ORDER = ":order="  # in a device layout tag, what follows is the physical order of a page's dims


def logical_layout(tag: str) -> str:
    """A layout tag without its physical page order: what a path that moves blocks in logical order (TCP) needs to
    match."""
    return tag.split(PAGE_ORDER, 1)[0]


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """What two instances must agree on before one may write KV blocks into the other.

    Everything that shapes a block's logical bytes is here: the CPU attention kernels store K transposed or tiled
    depending on ISA, hence ``kv_layout``. A device tag also names the physical order of a page's dims, which only
    a path that moves raw pages (NIXL) needs to match (``same_pages``); TCP carries blocks in logical order and
    writes them back through the cache's own strides, so ``incompatibility`` compares the logical part alone.
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    kv_layout: str
    tp_rank: int = 0
    tp_size: int = 1
    block_bytes: int = 0  # bytes of one block of one layer (all KV heads of this rank)

    def incompatibility(
        self, other: KVGeometry, ignore: tuple[str, ...] = ()
    ) -> tuple[str, object, object] | None:
        """The first field that differs (name, ours, theirs), or None when blocks can move between us."""
        for name in (
            "model",
            "num_layers",
            "num_kv_heads",
            "head_size",
            "block_size",
            "dtype",
            "kv_layout",
            "tp_size",
            "tp_rank",
            "block_bytes",
        ):
            ours, theirs = getattr(self, name), getattr(other, name)
            if name == "kv_layout":
                ours, theirs = logical_layout(ours), logical_layout(theirs)
            if ours != theirs and name not in ignore:
                return name, ours, theirs
        return None

    def same_pages(self, other: KVGeometry) -> bool:
        """Whether a block's raw page bytes mean the same on both sides (the physical page order matches too)."""
        return self.kv_layout == other.kv_layout


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes. Llama-3-8B bf16: 2*32*8*128*2 = 131072 (128 KiB)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class StepChunk:
    """One scheduler step of a request whose prompt KV is being sent.

    ``start``: prompt tokens computed (or prefix-cached) before this step; ``end``: after it (capped at the prompt).
    """

    start: int
    end: int
    prompt_len: int
    block_size: int
    first_step: bool

    def sendable_blocks(self) -> range:
        """Logical block indices whose prompt KV is complete after this step and was not complete before.

        A block is complete when all its prompt positions are computed: a full block, or the prompt's last partial
        block once the prompt is done. In the request's first step, blocks served from the local prefix cache
        (before ``start``) are complete too and have not been offered yet.
        """
        bs = self.block_size
        end = min(self.end, self.prompt_len)
        done_after = end // bs if end < self.prompt_len else num_blocks(self.prompt_len, bs)
        if self.first_step:
            done_before = 0
        else:
            start = min(self.start, self.prompt_len)
            done_before = start // bs if start < self.prompt_len else num_blocks(self.prompt_len, bs)
        return range(done_before, max(done_before, done_after))


@dataclass(frozen=True)
class PageLayout:
    """Where block ``b``'s bytes live in one layer's storage: ``base + b * block_stride``, ``page_bytes`` long.

    Only a *dense* page (the per-block dims tile one run of bytes, in any order) has such an address; ``order``
    says in which physical order the logical per-block dims ``[H, N, C]`` are stored, so two instances can check
    that their pages mean the same thing byte for byte before one writes into the other's memory (NIXL).
    """

    base: int  # byte offset of block 0's page from the start of the storage
    block_stride: int  # bytes from one block's page to the next (>= page_bytes; padding allowed)
    page_bytes: int
    order: tuple[int, ...]  # per-block logical dims, outermost physical first; (0, 1, 2) = [H, N, C] dense


def page_layout(
    shape: tuple[int, ...], strides: tuple[int, ...], element_size: int, storage_offset: int
) -> PageLayout | None:
    """The page layout of a block-major ``[num_blocks, ...]`` view, or None when a block's bytes are not one dense
    run (e.g. heads outermost, as vLLM's LHBNC/BHLNC layouts store them) or blocks overlap."""
    if len(shape) < 2 or len(shape) != len(strides):
        return None
    dims = [(strides[i], shape[i], i - 1) for i in range(1, len(shape)) if shape[i] != 1]
    dims.sort(key=lambda d: -d[0])
    expected = 1
    for stride, size, _ in reversed(dims):
        if stride != expected:
            return None
        expected *= size
    page = expected * element_size
    block_stride = strides[0] * element_size
    if shape[0] > 1 and block_stride < page:
        return None
    ones = [i - 1 for i in range(1, len(shape)) if shape[i] == 1]
    order = tuple(d[2] for d in dims) + tuple(ones)
    return PageLayout(
        base=storage_offset * element_size, block_stride=block_stride, page_bytes=page, order=order
    )


def merge_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of ``(start, length)`` byte ranges, as disjoint sorted ranges (NIXL registers each once)."""
    out: list[list[int]] = []
    for start, length in sorted(spans):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return [(s, n) for s, n in out]
