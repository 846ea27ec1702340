"""PrefixIndex: chained token-id keys fed by (simulated) vLLM events, and the approximate routed index."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from vllm_disagg.router.prefix_index import BlockKeys, PrefixHit, PrefixIndex, block_keys

BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def vhash(i: int) -> int:
    """A stand-in for vLLM's block hash: arbitrary, unrelated to our keys on purpose."""
    return 0xABC000 + i


def test_block_keys_are_deterministic_chained_and_process_independent() -> None:
    prompt = toks(10)
    keys = block_keys(prompt, BS)
    assert isinstance(keys, BlockKeys) and len(keys) == 2  # the partial third block has no key
    assert keys == block_keys(prompt + [99], BS)
    # Same second block after a different first block: a different key (keys chain over the whole prefix).
    other = block_keys([100, 101, 102, 103] + prompt[4:8], BS)
    assert other[1] != keys[1]
    # A fresh interpreter (different PYTHONHASHSEED) computes the same keys.
    code = (
        "from vllm_disagg.router.prefix_index import block_keys; print(list(block_keys(list(range(10)), 4)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=None)
    assert out.stdout.strip() == str(list(keys))


def test_stored_chains_through_parent_hashes_across_events() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(16)
    # Two events for one prompt, the second naming the first's last block as parent (vLLM's chunked prefill).
    assert idx.apply_stored("a", [vhash(0), vhash(1)], None, prompt[:8], BS) == 2
    assert idx.apply_stored("a", [vhash(2), vhash(3)], vhash(1), prompt[8:16], BS) == 2
    assert idx.cached_tokens("a", prompt) == 16
    assert idx.cached_tokens("a", prompt + [1, 2, 3]) == 16  # partial trailing block ignored
    assert idx.cached_tokens("a", prompt[:9]) == 8  # partial-block prompt: only its full blocks
    assert idx.cached_tokens("a", prompt[:3]) == 0
    assert idx.cached_tokens("a", [7] + prompt[1:]) == 0  # first block differs: nothing usable
    assert idx.match(prompt) == {"a": 16}
    # The same keys whether the prompt arrives as tokens or as precomputed keys.
    keys = idx.block_keys(prompt)
    assert idx.cached_tokens("a", keys) == 16 and idx.match(keys) == {"a": 16}


def test_orphan_parent_is_not_guessed() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(8)
    # We never saw the parent (joined late): indexing these tokens as a root would invent a hit.
    assert idx.apply_stored("a", [vhash(1)], vhash(0), prompt[4:8], BS) == 0
    assert idx.match(prompt) == {"a": 0}
    assert idx.match(prompt[4:8]) == {"a": 0}
    assert idx.stats()["instances"]["a"]["orphan_events"] == 1


def test_removal_in_the_middle_breaks_the_prefix_after_it() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(16)
    idx.apply_stored("a", [vhash(i) for i in range(4)], None, prompt, BS)
    assert idx.apply_removed("a", [vhash(1), 0xDEAD]) == 1  # unknown hashes are no-ops
    assert idx.cached_tokens("a", prompt) == 4
    # Re-storing the evicted block (a new request recomputed it) restores the whole prefix.
    idx.apply_stored("a", [vhash(1)], vhash(0), prompt[4:8], BS)
    assert idx.cached_tokens("a", prompt) == 16
    assert idx.stats()["instances"]["a"]["blocks"] == 4


def test_same_tokens_under_two_vllm_hashes_are_refcounted() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(4)
    idx.apply_stored("a", [vhash(0)], None, prompt, BS, medium="GPU")
    idx.apply_stored("a", [vhash(0)], None, prompt, BS, group=1)  # the same tokens in a second KV group
    idx.apply_stored("a", [vhash(0)], None, prompt, BS, medium="GPU")  # re-announced: idempotent
    idx.apply_removed("a", [vhash(0)], medium="GPU")
    assert idx.cached_tokens("a", prompt) == 4  # still held under the other group's entry
    idx.apply_removed("a", [vhash(0)], group=1)
    assert idx.cached_tokens("a", prompt) == 0


def test_a_tier_beneath_the_engine_is_counted_apart_from_its_cache() -> None:
    """An offloaded (medium CPU) copy is not a device hit: it costs a load. After the device copy goes, the prefix
    is still reachable through the tier; once the tier drops it too, nothing is."""
    idx = PrefixIndex(BS)
    prompt = toks(12)
    idx.apply_stored("a", [vhash(i) for i in range(3)], None, prompt, BS, medium="GPU")
    idx.apply_stored("a", [vhash(i) for i in range(3)], None, prompt, BS, medium="CPU")
    assert idx.match_tiers(prompt)["a"] == PrefixHit(12, 0, ())
    idx.apply_removed("a", [vhash(1), vhash(2)], medium="GPU")
    assert idx.cached_tokens("a", prompt) == 4
    assert idx.match_tiers(prompt)["a"] == PrefixHit(4, 8, ("CPU",))
    assert idx.match(prompt) == {"a": 4}  # match() is the device cache alone
    idx.apply_removed("a", [vhash(2)], medium="CPU")
    assert idx.match_tiers(prompt)["a"] == PrefixHit(4, 4, ("CPU",))
    st = idx.stats()["instances"]["a"]
    assert st["blocks"] == 1 and st["tier_blocks"] == {"CPU": 2} and st["tier_hits"] == 3


def test_held_blocks_is_the_longest_reach_over_instances_and_counts_no_lookup() -> None:
    """What intake asks before tokenizing further: the most leading blocks one instance can serve, from its cache
    and a tier beneath it together; not a lookup, so the hit statistics do not move."""
    idx = PrefixIndex(BS)
    prompt = toks(20)
    assert idx.held_blocks(prompt) == 0
    idx.apply_stored("a", [vhash(i) for i in range(2)], None, prompt[:8], BS, medium="GPU")
    idx.apply_stored("a", [vhash(i) for i in range(4)], None, prompt[:16], BS, medium="CPU")
    idx.apply_stored("b", [vhash(i) for i in range(3)], None, prompt[:12], BS, medium="GPU")
    assert idx.held_blocks(prompt) == 4  # a: 2 in its cache + 2 more in its CPU tier; b: 3
    assert idx.held_blocks(block_keys(prompt, BS)) == 4
    assert idx.held_blocks(toks(20, start=1)) == 0
    stats = idx.stats()
    assert stats["lookups"] == 0 and all(st["lookups"] == 0 for st in stats["instances"].values())


def test_coarse_tier_chunks_line_up_with_engine_blocks() -> None:
    """LMCache announces 256-token chunks over 128-token engine blocks: a chunk of k blocks is k of our keys, so a
    device prefix and a tier prefix of the same tokens meet, and a removed chunk takes all k with it."""
    idx = PrefixIndex(BS)
    prompt = toks(24)
    chunk = 2 * BS
    idx.apply_stored("a", [b"c0", b"c1"], None, prompt[: 2 * chunk], chunk, medium="CPU")
    assert idx.match_tiers(prompt)["a"] == PrefixHit(0, 16, ("CPU",))
    idx.apply_stored("a", [vhash(0)], None, prompt[:BS], BS, medium="GPU")  # the engine holds block 0
    assert idx.match_tiers(prompt)["a"] == PrefixHit(4, 12, ("CPU",))
    idx.apply_stored("a", [b"c2"], b"c1", prompt[2 * chunk : 3 * chunk], chunk, medium="CPU")  # chained on c1
    assert idx.match_tiers(prompt + [99])["a"] == PrefixHit(4, 20, ("CPU",))  # all 24 whole tokens
    idx.apply_removed("a", [b"c1"], medium="CPU")
    assert idx.match_tiers(prompt)["a"] == PrefixHit(4, 4, ("CPU",))
    # A tier whose chunk is not a whole number of blocks is ignored on its own; the device cache still counts.
    assert idx.apply_stored("a", [b"x"], None, prompt[:6], 6, medium="DISK") == 0
    assert "DISK" in idx.stats()["instances"]["a"]["ignored_media"]
    assert idx.ignored_reason("a") is None and idx.cached_tokens("a", prompt) == 4


def test_a_prefix_cache_reset_keeps_the_tier() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(8)
    idx.apply_stored("a", [vhash(0), vhash(1)], None, prompt, BS, medium="GPU")
    idx.apply_stored("a", [b"t0"], None, prompt, 2 * BS, medium="CPU")
    idx.clear("a", device_only=True)  # vLLM's AllBlocksCleared
    assert idx.match_tiers(prompt)["a"] == PrefixHit(0, 8, ("CPU",))
    idx.clear("a")  # a restart or an event gap: everything
    assert idx.match_tiers(prompt)["a"] == PrefixHit(0, 0, ())


def test_lora_and_extra_key_blocks_are_skipped() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(12)
    assert idx.apply_stored("a", [vhash(0)], None, prompt[:4], BS, lora="my-adapter") == 0
    # An image placeholder in block 1: blocks 1.. are not just their tokens.
    assert (
        idx.apply_stored(
            "b", [vhash(i) for i in range(3)], None, prompt, BS, extra_keys=[None, ("img", 0), None]
        )
        == 1
    )
    assert idx.match(prompt) == {"a": 0, "b": 4}
    assert idx.stats()["instances"]["b"]["skipped_blocks"] == 2


def test_a_salted_chain_is_indexed_where_only_its_salt_looks() -> None:
    """vLLM mixes a request's cache_salt into its first block (the block's only extra key) and reuses the chain for
    the same salt: it is indexed from that salt's root, so a same-salt request matches and others do not."""
    from vllm_disagg.router.prefix_index import iter_block_keys, salted_root

    idx = PrefixIndex(BS)
    prompt = toks(12)
    stored = idx.apply_stored(
        "a", [vhash(0), vhash(1)], None, prompt[:8], BS, extra_keys=[["tenant-1"], None]
    )
    assert stored == 2
    assert idx.apply_stored("a", [vhash(2)], vhash(1), prompt[8:12], BS) == 1  # the chain goes on from it
    salted = BlockKeys(list(iter_block_keys(prompt, BS, 3, salted_root("tenant-1"))), BS)
    other = BlockKeys(list(iter_block_keys(prompt, BS, 3, salted_root("tenant-2"))), BS)
    assert idx.cached_tokens("a", salted) == 12
    assert idx.cached_tokens("a", other) == idx.cached_tokens("a", prompt) == 0
    # a first block with a multimodal key (or more than the salt) is not a salted chain: skipped as before
    assert idx.apply_stored("b", [vhash(5)], None, prompt[:4], BS, extra_keys=[["tenant-1", ("img", 0)]]) == 0


def test_a_group_that_lists_fewer_hashes_than_blocks_is_not_indexed() -> None:
    """A hybrid model's SWA or Mamba group leaves masked blocks out of block_hashes but publishes every token: the
    hashes cannot be paired with blocks, and pairing them in order once kept a prefix the engine had evicted."""
    idx = PrefixIndex(BS)
    prompt = toks(4 * BS)
    assert idx.apply_stored("a", [vhash(3)], None, prompt, BS, group=1) == 0
    assert idx.cached_tokens("a", prompt) == 0


def test_clear_and_remove_instance() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(8)
    for inst in ("a", "b"):
        idx.apply_stored(inst, [vhash(0), vhash(1)], None, prompt, BS)
    idx.clear("a")
    assert idx.match(prompt) == {"a": 0, "b": 8}
    idx.remove_instance("b")
    assert idx.match(prompt) == {"a": 0}
    assert idx.instances() == ["a"]
    # After a clear, the old hashes are unknown: a child of a cleared block is an orphan.
    assert idx.apply_stored("a", [vhash(2)], vhash(1), toks(4, 8), BS) == 0


def test_block_size_mismatch_ignores_the_instance(caplog: pytest.LogCaptureFixture) -> None:
    idx = PrefixIndex(BS)
    prompt = toks(16)
    idx.apply_stored("a", [vhash(0)], None, prompt[:4], BS)
    with caplog.at_level(logging.ERROR):
        assert idx.apply_stored("a", [vhash(9)], None, prompt[:6], 6) == 0
    reason = idx.ignored_reason("a")
    assert reason is not None and "block_size 6" in reason and "block_size 4" in reason
    assert "ignoring KV events of a" in caplog.text
    # Everything from that instance is ignored from now on, including what it had before.
    assert idx.apply_stored("a", [vhash(0)], None, prompt[:4], BS) == 0
    assert idx.cached_tokens("a", prompt) == 0
    assert idx.stats()["instances"]["a"]["ignored"] == reason
    idx.remove_instance("a")
    assert idx.ignored_reason("a") is None
    with pytest.raises(ValueError, match="block_size"):
        idx.cached_tokens("a", block_keys(prompt, 8))


def test_approximate_entries_expire_with_the_clock() -> None:
    clock = FakeClock()
    idx = PrefixIndex(BS, approx_ttl_s=10.0, clock=clock)
    prompt = toks(10)
    assert idx.record_routed("x", prompt) == 2
    assert idx.cached_tokens("x", prompt) == 8
    clock.t += 6
    idx.record_routed("x", prompt[:4])  # refreshes block 0 only
    clock.t += 5  # block 1 expired, block 0 refreshed
    assert idx.cached_tokens("x", prompt) == 4
    assert idx.stats()["instances"]["x"]["approx_blocks"] == 1  # the expired entry was swept
    clock.t += 10
    assert idx.match(prompt) == {"x": 0}
    assert idx.stats()["instances"]["x"]["approx_blocks"] == 0


def test_precise_instance_ignores_routed_records() -> None:
    clock = FakeClock()
    idx = PrefixIndex(BS, clock=clock)
    prompt = toks(8)
    idx.record_routed("p", prompt)
    idx.set_precise("p", True)  # drops what was recorded before the events started
    assert idx.record_routed("p", prompt) == 0
    assert idx.match(prompt) == {"p": 0}
    idx.apply_stored("p", [vhash(0)], None, prompt[:4], BS)
    assert idx.match(prompt) == {"p": 4}
    idx.set_precise("p", False)  # no events keep it current any more
    assert idx.match(prompt) == {"p": 0}


def test_a_pending_prompt_counts_on_its_instance_until_events_or_its_ttl() -> None:
    """A prompt just routed to a precise instance counts there for ``pending_ttl_s``: a prompt sharing its prefix
    that arrives before the KV events finds it there, not nowhere. Its blocks that events then report stay; the
    rest lapse with the TTL. Probing the instance again (set_precise) keeps them."""
    clock = FakeClock()
    idx = PrefixIndex(BS, clock=clock, pending_ttl_s=5.0)
    idx.set_precise("a", True)
    prompt = toks(12)
    assert idx.record_pending("a", prompt) == 3
    assert idx.match(prompt[:8] + toks(4, 100)) == {"a": 8}  # same prefix, another suffix
    idx.set_precise("a", True)
    clock.t += 2
    idx.apply_stored("a", [vhash(0)], None, prompt[:4], BS)  # the first block computed and announced
    assert idx.cached_tokens("a", prompt) == 12
    clock.t += 4  # past the TTL: what events reported stays
    assert idx.cached_tokens("a", prompt) == 4
    assert idx.stats()["instances"]["a"]["approx_blocks"] == 0  # swept
    assert idx.record_pending("a", prompt[:4]) == 0  # already reported stored: nothing pending to add
    idx.record_pending("a", toks(8, 50))
    clock.t += 3
    assert idx.record_pending("a", toks(8, 50)) == 0  # a follower does not extend the first one's TTL
    clock.t += 3
    assert idx.cached_tokens("a", toks(8, 50)) == 0


def test_pending_blocks_go_with_an_eviction_a_clear_or_a_zero_ttl() -> None:
    clock = FakeClock()
    idx = PrefixIndex(BS, clock=clock)
    idx.set_precise("a", True)
    prompt = toks(8)
    idx.apply_stored("a", [vhash(0)], None, prompt[:4], BS)
    idx.record_pending("a", prompt)
    assert idx.cached_tokens("a", prompt) == 8
    idx.apply_stored("a", [vhash(9)], None, prompt[:4], BS, medium="CPU")
    idx.apply_removed("a", [vhash(9)], medium="CPU")  # a tier beneath dropped its copy: the engine's stays
    assert idx.cached_tokens("a", prompt) == 8
    idx.apply_removed("a", [vhash(0)])  # the engine evicted block 0: its pending record is stale too
    assert idx.cached_tokens("a", prompt) == 0
    idx.record_pending("a", prompt)
    idx.clear("a", device_only=True)
    assert idx.cached_tokens("a", prompt) == 0
    off = PrefixIndex(BS, pending_ttl_s=0.0)
    assert off.record_pending("a", prompt) == 0 and off.match(prompt) == {}


def test_match_reports_every_instance_and_counts_lookups() -> None:
    idx = PrefixIndex(BS)
    prompt = toks(12)
    idx.apply_stored("a", [vhash(i) for i in range(3)], None, prompt, BS)
    idx.apply_stored("b", [vhash(0)], None, prompt[:4], BS)
    idx.set_precise("c", True)
    idx.record_routed("d", prompt[:8])
    assert idx.match(prompt) == {"a": 12, "b": 4, "c": 0, "d": 8}
    assert idx.match(toks(12, 500)) == {"a": 0, "b": 0, "c": 0, "d": 0}
    s = idx.stats()
    assert (s["lookups"], s["hits"]) == (2, 1)
    assert s["instances"]["a"]["blocks"] == 3 and s["instances"]["d"]["approx_blocks"] == 2


def test_bytes_hashes_and_concurrent_writers() -> None:
    idx = PrefixIndex(BS)
    prompts = [toks(64, 1000 * w) for w in range(4)]

    def writer(w: int) -> None:
        parent: bytes | None = None
        for b in range(16):
            h = bytes([w, b]) * 16  # sha256-style digest bytes
            idx.apply_stored(f"i{w}", [h], parent, prompts[w][b * BS : (b + 1) * BS], BS)
            parent = h

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for _ in range(50):
        idx.match(prompts[0])
    for t in threads:
        t.join()
    for w in range(4):
        assert idx.match(prompts[w])[f"i{w}"] == 64


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(0)
