"""Which instance holds which token-id prefix: the proxy's prefix index.

Keys are our own, never vLLM's block hashes: recomputing vLLM's hashes couples the router to its hash
algorithm, seed and extra keys, and any mismatch silently gives 0 % hits. vLLM's ``BlockStored`` events carry the
token ids, so we chain our own key over them::

    key(block 0) = H(ROOT, tokens of block 0)
    key(block i) = H(key(block i-1), tokens of block i)

with ``H`` = blake2b-64 over little-endian int64 token ids: fixed across processes, hosts and Python runs (unlike
``hash()``). Per instance we keep vLLM's block hash -> our key, so a stored block whose ``parent_block_hash`` we saw
chains correctly and ``BlockRemoved`` (vLLM hashes only) finds what to drop.

Two kinds of entries:
  * precise: fed by an instance's KV events (``apply_stored``/``apply_removed``/``clear``).
    Each event names a medium. ``None``/``"GPU"`` is the engine's own cache (a hit costs nothing); any other medium
    ("CPU" from LMCache's connector or vLLM's offloading, "DISK", ...) is a *tier* beneath the engine (a hit costs a
    load, not a prefill). Tier blocks may be coarser than the engine's (LMCache: 256-token chunks): an event block of
    ``k * block_size`` tokens is indexed as ``k`` of our blocks, so the keys of both media line up.
  * approximate: for instances that publish no events, what the proxy routed there (``record_routed``), trusted
    for ``approx_ttl_s``. Instances marked precise ignore routed records.
  * pending: a prompt just sent to an instance to be computed (``record_pending``), counted there for
    ``pending_ttl_s``: its blocks are computed, and announced by events, only after its prefill. Without them, the
    prompts that arrive meanwhile with the same new prefix (a cold start of repeated prefixes) each find it
    nowhere, and each is planned as a prompt to compute in full; with them, they find it where it is being computed
    (vLLM there serves them its blocks as they are computed).

Invariant kept on every uncertainty (orphan parents, LoRA/multimodal/salted blocks, gaps handled by the caller via
``clear``): the precise index holds a *subset* of what the engine caches, so a hit is never invented, but for a
pending prompt's blocks, for ``pending_ttl_s`` (a routing hint: nothing on the data path trusts the index).

Thread-safe with one lock: subscriber threads write, the proxy's event loop reads.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from mypy_extensions import mypyc_attr

log = logging.getLogger(__name__)

# vLLM's ExternalBlockHash: the low 64 bits as an int (default) or the raw digest bytes.
BlockHash: TypeAlias = "int | bytes"
# (medium, kv-cache group): where vLLM says a block lives; the same block may be in several (GPU + CPU offload).
Tier: TypeAlias = "tuple[str | None, int | None]"
# Media that are the engine's own KV cache; every other medium is a tier beneath it.
DEVICE_MEDIA: frozenset[str | None] = frozenset({None, "GPU", "gpu", "cuda", "CUDA"})


def is_device(medium: str | None) -> bool:
    return medium in DEVICE_MEDIA


@dataclass(frozen=True)
class PrefixHit:
    """How much of a prompt one instance can skip computing.

    ``cached_tokens`` sit in its own cache; the next ``tier_tokens`` can be loaded from a tier beneath it (a prefix
    of the prompt, counted from ``cached_tokens``); ``media`` names the tiers that hold them.
    """

    cached_tokens: int = 0
    tier_tokens: int = 0
    media: tuple[str, ...] = ()

    def capped(self, reusable: int) -> PrefixHit:
        """This hit as far as a prompt lets it be used: at most ``reusable`` tokens, cache first."""
        if self.cached_tokens + self.tier_tokens <= reusable:
            return self
        cached = min(self.cached_tokens, reusable)
        tier = min(self.tier_tokens, reusable - cached)
        return PrefixHit(cached, tier, self.media if tier else ())


_ROOT = hashlib.blake2b(b"vllm-disagg/prefix-index/v1", digest_size=8).digest()


def _iter_keys(
    token_ids: Sequence[int], block_size: int, n_blocks: int, parent: bytes = _ROOT
) -> Iterator[int]:
    """Chained keys of the first ``n_blocks`` full blocks, lazily: a miss costs one block's packing and hashing.

    Tokens are packed as little-endian int64 (host-independent) in chunks of 1, 4, 16, ... blocks: packing a 2k
    prompt at once costs more than hashing its first block.
    """
    step = block_size * 8
    prev = parent
    b2b = hashlib.blake2b
    done, chunk = 0, 1
    while done < n_blocks:
        m = min(chunk, n_blocks - done)
        lo, cnt = done * block_size, m * block_size
        buf = struct.pack(f"<{cnt}q", *token_ids[lo : lo + cnt])
        for j in range(m):
            prev = b2b(prev + buf[j * step : (j + 1) * step], digest_size=8).digest()
            yield int.from_bytes(prev, "little")
        done += m
        chunk *= 4


def salted_root(salt: str) -> bytes:
    """The chain's start for a request with ``cache_salt``: vLLM mixes the salt into its first block's hash, so
    its blocks are reused by requests with the same salt only."""
    return hashlib.blake2b(_ROOT + b"salt" + salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def iter_block_keys(
    token_ids: Sequence[int], block_size: int, n_blocks: int, root: bytes | None = None
) -> Iterator[int]:
    """The chained keys of the first ``n_blocks`` full blocks, one at a time (for callers that pace the work);
    ``root`` starts a salted chain (``salted_root``)."""
    return _iter_keys(token_ids, block_size, n_blocks, _ROOT if root is None else root)


def _salt_of(first_block_keys: object) -> str | None:
    """The cache salt among a first block's extra keys, as vLLM's BlockStored carries it: the only key, a string
    (multimodal inputs and prompt embeddings add keys of their own, and such blocks are not indexed)."""
    if isinstance(first_block_keys, list | tuple) and len(first_block_keys) == 1:
        (key,) = first_block_keys
        if isinstance(key, str) and key:
            return key
    return None


def _key_bytes(key: int) -> bytes:
    return key.to_bytes(8, "little")


@mypyc_attr(native_class=False)  # mypyc compiles this module; a native class cannot extend list
class BlockKeys(list[int]):
    """Keys of a prompt's full blocks. A distinct type so ``cached_tokens``/``match``/``record_routed`` can take
    either token ids or precomputed keys (hash once, use for lookup and for recording the routing decision)."""

    block_size: int

    def __init__(self, keys: Sequence[int] = (), block_size: int = 0) -> None:
        super().__init__(keys)
        self.block_size = block_size


def block_keys(token_ids: Sequence[int], block_size: int) -> BlockKeys:
    """Keys of the full blocks of ``token_ids`` (a trailing partial block is not cacheable in vLLM)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return BlockKeys(list(_iter_keys(token_ids, block_size, len(token_ids) // block_size)), block_size)


class _LazyKeys:
    """Keys computed on demand: a lookup that misses everywhere after block j hashes only j+1 blocks."""

    __slots__ = ("_it", "keys", "n")

    def __init__(self, token_ids_or_keys: Sequence[int], block_size: int) -> None:
        if isinstance(token_ids_or_keys, BlockKeys):
            if token_ids_or_keys.block_size not in (0, block_size):
                raise ValueError(
                    f"keys were computed for block_size {token_ids_or_keys.block_size}, index uses {block_size}"
                )
            self.keys: list[int] = token_ids_or_keys
            self.n = len(token_ids_or_keys)
            self._it: Iterator[int] | None = None
        else:
            self.n = len(token_ids_or_keys) // block_size
            self.keys = []
            self._it = _iter_keys(token_ids_or_keys, block_size, self.n)

    def more(self) -> bool:
        """Compute the next key; False once all are known."""
        if self._it is None or len(self.keys) >= self.n:
            return False
        self.keys.append(next(self._it))
        return True

    def all(self) -> list[int]:
        while self.more():
            pass
        return self.keys


@dataclass
class _Instance:
    precise: bool = False
    # key -> how many (device tier, vLLM hash) entries hold it: LoRA-free duplicates share a key
    refs: dict[int, int] = field(default_factory=dict)
    # medium -> key -> count, for media beneath the engine (LMCache CPU/disk, offloading)
    tier_refs: dict[str, dict[int, int]] = field(default_factory=dict)
    # tier -> vLLM hash -> our keys (one per block of ours: a coarse tier block covers several)
    tiers: dict[Tier, dict[BlockHash, tuple[int, ...]]] = field(default_factory=dict)
    ignored_media: dict[str, str] = field(default_factory=dict)  # tier medium -> why its events are ignored
    approx: dict[int, float] = field(default_factory=dict)  # key -> expiry (clock time)
    ignored: str | None = None  # why this instance's events are ignored
    orphan_events: int = 0  # BlockStored whose parent we never saw (joined late / after a clear)
    skipped_blocks: int = 0  # LoRA / extra-key blocks: their cache depends on more than token ids
    lookups: int = 0
    hits: int = 0
    tier_hits: int = 0
    resets: int = 0  # clears of everything known (not vLLM's own prefix-cache resets)

    def key_of(self, h: BlockHash, tier: Tier) -> int | None:
        """Our key (of the last block) for a vLLM hash, preferring the event's tier (keys are the same in every
        tier, but hashes of different media need not be)."""
        own = self.tiers.get(tier)
        if own is not None and h in own:
            return own[h][-1]
        for hashes in self.tiers.values():
            ks = hashes.get(h)
            if ks is not None:
                return ks[-1]
        return None

    def refs_for(self, medium: str | None) -> dict[int, int]:
        return self.refs if is_device(medium) else self.tier_refs.setdefault(str(medium), {})

    def tier_blocks(self, keys: _LazyKeys, start: int) -> tuple[int, tuple[str, ...]]:
        """Blocks from ``start`` on that some tier holds (a block may come from any tier); and which tiers."""
        if not self.tier_refs:
            return 0, ()
        i, used = start, set()
        ks = keys.keys
        while i < len(ks) or keys.more():
            k = ks[i]
            medium = next((m for m, r in self.tier_refs.items() if k in r), None)
            if medium is None:
                break
            used.add(medium)
            i += 1
        return i - start, tuple(sorted(used))

    def cached_blocks(self, keys: _LazyKeys, now: float) -> int:
        refs, approx, ks = self.refs, self.approx, keys.keys
        i = 0
        while True:  # tight loops over the keys computed so far; compute one more only when all of them hit
            m = len(ks)
            if approx:
                while i < m and (ks[i] in refs or approx.get(ks[i], -math.inf) > now):
                    i += 1
            else:
                while i < m and ks[i] in refs:
                    i += 1
            if i < m or not keys.more():
                return i

    def drop_precise(self) -> None:
        self.refs.clear()
        self.tier_refs.clear()
        self.tiers.clear()

    def drop_device(self) -> None:
        """Forget the engine's own cache; tiers beneath it outlive a prefix-cache reset."""
        self.refs.clear()
        for tier in [t for t in self.tiers if is_device(t[0])]:
            del self.tiers[tier]


class PrefixIndex:
    """Longest cached token prefix per instance, from KV events (precise) or routing history (approximate)."""

    def __init__(
        self,
        block_size: int,
        approx_ttl_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        pending_ttl_s: float = 10.0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.approx_ttl_s = approx_ttl_s
        self.pending_ttl_s = pending_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._insts: dict[str, _Instance] = {}
        # (expiry, instance, key), in expiry order but for entries refreshed since (lookups check each expiry).
        self._expiries: deque[tuple[float, str, int]] = deque()
        self._pending_expiries: deque[tuple[float, str, int]] = deque()
        self._lookups = 0
        self._hits = 0

    # -- keys ------------------------------------------------------------------------------------------------

    def block_keys(self, token_ids: Sequence[int]) -> BlockKeys:
        """Keys of the full blocks of a prompt; pass them to ``match``/``cached_tokens``/``record_routed``."""
        return block_keys(token_ids, self.block_size)

    # -- precise entries (KV events) -------------------------------------------------------------------------

    def apply_stored(
        self,
        instance: str,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        medium: str | None = None,
        group: int | None = None,
        lora: str | int | None = None,
        extra_keys: Sequence[object | None] | None = None,
    ) -> int:
        """Index a ``BlockStored`` event; returns how many blocks were indexed.

        Blocks whose cache depends on more than token ids (a LoRA, or per-block extra keys: multimodal inputs)
        are skipped, as are their descendants (their parent is then unknown), so a plain-text request never matches
        them. A chain whose first block's only extra key is a cache salt is indexed from that salt's root
        (``salted_root``), where only requests with the same salt look.
        """
        with self._lock:
            st = self._state(instance)
            if st.ignored is not None:
                return 0
            if block_size % self.block_size != 0:
                why = (
                    f"block_size {block_size} of medium {medium or 'GPU'} is not a multiple of the index "
                    f"block_size {self.block_size}; start the proxy with the engine's --block-size"
                )
                if is_device(medium):
                    self._ignore(instance, st, why)
                elif str(medium) not in st.ignored_media:
                    st.ignored_media[str(medium)] = why
                    log.error("prefix index: ignoring %s's %s tier: %s", instance, medium, why)
                return 0
            per = block_size // self.block_size  # our blocks per event block
            if len(block_hashes) != len(token_ids) // block_size:
                # A group that keeps some blocks (a hybrid model's SWA or Mamba group leaves out masked ones)
                # lists fewer hashes than its tokens have blocks: which hash goes with which block is unknowable.
                st.skipped_blocks += len(block_hashes)
                return 0
            n = len(block_hashes)
            if lora is not None:
                st.skipped_blocks += len(block_hashes)
                return 0
            root = _ROOT
            if extra_keys is not None:
                first = 0
                if parent_block_hash is None and extra_keys and (salt := _salt_of(extra_keys[0])) is not None:
                    root, first = salted_root(salt), 1  # a salted chain: its first block's only extra key
                cut = next((i for i, e in enumerate(extra_keys[first:n], first) if e is not None), n)
                st.skipped_blocks += len(block_hashes) - cut
                n = cut
            tier: Tier = (medium, group)
            if parent_block_hash is None:
                parent = root
            else:
                pk = st.key_of(parent_block_hash, tier)
                if pk is None:
                    st.orphan_events += 1
                    return 0
                parent = _key_bytes(pk)
            if n == 0:
                return 0
            hashes = st.tiers.setdefault(tier, {})
            refs = st.refs_for(medium)
            keys = list(_iter_keys(token_ids, self.block_size, n * per, parent))
            for i, h in enumerate(block_hashes[:n]):
                ks = tuple(keys[i * per : (i + 1) * per])
                old = hashes.get(h)
                if old == ks:
                    continue  # re-announced block: idempotent
                if old is not None:
                    for k in old:
                        self._unref(refs, k)
                hashes[h] = ks
                for k in ks:
                    refs[k] = refs.get(k, 0) + 1
            return n

    def apply_removed(
        self,
        instance: str,
        block_hashes: Sequence[BlockHash],
        *,
        medium: str | None = None,
        group: int | None = None,
    ) -> int:
        """Drop blocks by vLLM hash (unknown hashes are no-ops); returns how many were known."""
        with self._lock:
            st = self._insts.get(instance)
            if st is None or st.ignored is not None:
                return 0
            hashes = st.tiers.get((medium, group))
            if not hashes:
                return 0
            removed = 0
            refs = st.refs_for(medium)
            for h in block_hashes:
                ks = hashes.pop(h, None)
                if ks is not None:
                    for k in ks:
                        self._unref(refs, k)
                        if st.precise and is_device(medium) and k not in refs:
                            st.approx.pop(k, None)  # evicted from the engine: a pending record of it is stale
                    removed += 1
            return removed

    def clear(self, instance: str, *, device_only: bool = False) -> None:
        """Forget everything the instance caches (a restart, an unrecoverable event gap), or with ``device_only``
        only its own cache (vLLM's AllBlocksCleared: a prefix-cache reset leaves the tiers beneath it)."""
        with self._lock:
            # never made here: a late call for a removed instance would bring it back
            st = self._insts.get(instance)
            if st is None:
                return
            if device_only:
                st.drop_device()
            else:
                st.drop_precise()
                st.resets += 1
            st.approx.clear()

    def remove_instance(self, instance: str) -> None:
        """The instance left the pool: drop its state, including a block-size ignore reason."""
        with self._lock:
            self._insts.pop(instance, None)

    def set_precise(self, instance: str, precise: bool) -> None:
        """Whether the instance publishes KV events. Precise: routed records are dropped and ignored. Not
        precise: its event-fed entries are dropped (no events keep them current any more)."""
        with self._lock:
            st = self._state(instance)
            if precise and not st.precise:
                st.approx.clear()
            elif not precise:
                st.drop_precise()
            st.precise = precise

    def ignored_reason(self, instance: str) -> str | None:
        with self._lock:
            st = self._insts.get(instance)
            return None if st is None else st.ignored

    # -- approximate entries (routing history) ---------------------------------------------------------------

    def record_routed(self, instance: str, token_ids: Sequence[int]) -> int:
        """Remember the prompt was sent to an instance without events; returns the blocks recorded."""
        keys = _LazyKeys(token_ids, self.block_size)
        with self._lock:
            st = self._state(instance)
            if st.precise:
                return 0
            now = self._clock()
            self._expire(now)
            expiry = now + self.approx_ttl_s
            approx = st.approx
            for k in keys.all():
                if k not in approx:
                    self._expiries.append((expiry, instance, k))
                approx[k] = expiry  # a refresh re-queues itself when its old deque entry comes due
            return len(keys.keys)

    def record_pending(self, instance: str, token_ids_or_keys: Sequence[int]) -> int:
        """The prompt was just sent to ``instance`` to be computed there: count its blocks there for
        ``pending_ttl_s`` (routed records and events hold them longer). A block already counted keeps its expiry: prompts that follow a pending one do not extend it, so a prefix that events never report
        lapses after one TTL. Returns the blocks recorded; none with ``pending_ttl_s`` 0 or for an instance whose
        events are ignored."""
        if self.pending_ttl_s <= 0:
            return 0
        keys = _LazyKeys(token_ids_or_keys, self.block_size)
        with self._lock:
            st = self._state(instance)
            if st.ignored is not None:
                return 0
            now = self._clock()
            self._expire(now)
            expiry = now + self.pending_ttl_s
            approx, refs = st.approx, st.refs
            n = 0
            for k in keys.all():
                if k in refs or approx.get(k, -math.inf) > now:
                    continue
                if k not in approx:
                    self._pending_expiries.append((expiry, instance, k))
                approx[k] = expiry
                n += 1
            return n

    def _expire(self, now: float) -> None:
        for q in (self._expiries, self._pending_expiries):
            self._expire_queue(q, now)

    def _expire_queue(self, q: deque[tuple[float, str, int]], now: float) -> None:
        while q and q[0][0] <= now:
            _, instance, k = q.popleft()
            st = self._insts.get(instance)
            if st is None:
                continue
            exp = st.approx.get(k)
            if exp is None:
                continue
            if exp <= now:
                del st.approx[k]
            else:  # refreshed since: queued again where entries of its remaining life are
                short = exp - now <= self.pending_ttl_s
                (self._pending_expiries if short else self._expiries).append((exp, instance, k))

    # -- lookups ---------------------------------------------------------------------------------------------

    def cached_tokens(self, instance: str, token_ids_or_keys: Sequence[int]) -> int:
        """Longest cached prefix of a prompt on one instance, in tokens (whole blocks only)."""
        keys = _LazyKeys(token_ids_or_keys, self.block_size)
        with self._lock:
            now = self._clock()
            self._lookups += 1
            st = self._insts.get(instance)
            n = 0 if st is None else st.cached_blocks(keys, now)
            if st is not None:
                st.lookups += 1
                st.hits += n > 0
            self._hits += n > 0
            return n * self.block_size

    def match_tiers(self, token_ids_or_keys: Sequence[int]) -> dict[str, PrefixHit]:
        """Per known instance: cached prefix tokens, and how many more a tier beneath it holds."""
        keys = _LazyKeys(token_ids_or_keys, self.block_size)
        with self._lock:
            now = self._clock()
            out: dict[str, PrefixHit] = {}
            any_hit = False
            for name, st in self._insts.items():
                n = st.cached_blocks(keys, now)
                t, media = st.tier_blocks(keys, n)
                out[name] = PrefixHit(n * self.block_size, t * self.block_size, media)
                st.lookups += 1
                st.hits += n + t > 0
                st.tier_hits += t > 0
                any_hit = any_hit or n + t > 0
            self._lookups += 1
            self._hits += any_hit
            return out

    def held_blocks(self, token_ids_or_keys: Sequence[int]) -> int:
        """The most leading blocks of a prompt that one instance holds, in its own cache or a tier beneath it.
        Not counted as a lookup: intake asks it to decide how much of a long prompt to tokenize."""
        keys = _LazyKeys(token_ids_or_keys, self.block_size)
        with self._lock:
            now = self._clock()
            best = 0
            for st in self._insts.values():
                n = st.cached_blocks(keys, now)
                best = max(best, n + st.tier_blocks(keys, n)[0])
            return best

    def match(self, token_ids_or_keys: Sequence[int]) -> dict[str, int]:
        """Prefix tokens of a prompt in every known instance's own cache (0 where nothing matches; tiers aside)."""
        return {name: hit.cached_tokens for name, hit in self.match_tiers(token_ids_or_keys).items()}

    def instances(self) -> list[str]:
        with self._lock:
            return list(self._insts)

    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and debugging: blocks per instance, lookups, hits."""
        with self._lock:
            self._expire(self._clock())
            return {
                "block_size": self.block_size,
                "lookups": self._lookups,
                "hits": self._hits,
                "instances": {
                    name: {
                        "precise": st.precise,
                        "blocks": len(st.refs),
                        "tier_blocks": {m: len(r) for m, r in sorted(st.tier_refs.items())},
                        "approx_blocks": len(st.approx),
                        "lookups": st.lookups,
                        "hits": st.hits,
                        "tier_hits": st.tier_hits,
                        "orphan_events": st.orphan_events,
                        "skipped_blocks": st.skipped_blocks,
                        "ignored": st.ignored,
                        "ignored_media": dict(st.ignored_media),
                        "resets": st.resets,
                    }
                    for name, st in self._insts.items()
                },
            }

    # -- internals (lock held) -------------------------------------------------------------------------------

    def _state(self, instance: str) -> _Instance:
        st = self._insts.get(instance)
        if st is None:
            st = self._insts[instance] = _Instance()
        return st

    def _ignore(self, instance: str, st: _Instance, reason: str) -> None:
        st.ignored = reason
        st.drop_precise()
        log.error("prefix index: ignoring KV events of %s: %s", instance, reason)

    @staticmethod
    def _unref(refs: dict[int, int], k: int) -> None:
        c = refs.get(k, 0) - 1
        if c > 0:
            refs[k] = c
        else:
            refs.pop(k, None)
