"""PrefixIndex lookup speed: µs per ``match()`` of a 2k-token prompt against 8 instances x 50k blocks.

    python benchmarks/prefix_index.py [--instances 8] [--blocks 50000] [--block-size 16] [--prompt-tokens 2048]
                                      [--lookups 2000] [--json out.json]

The index is filled the way KV events fill it (``apply_stored``, one event per 2k-token prompt, chained from a
shared 512-token system prompt). Cases:
  * hit        -- a prompt cached on one instance (the others share only the system prompt): hashes every block
  * miss       -- an unseen prompt: one hash, then every instance misses
  * keys       -- ``block_keys()`` alone (the hashing part of a hit)
  * hit(keys)  -- ``match()`` with precomputed keys: the index walk alone
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_disagg.router.prefix_index import PrefixIndex


def _timeit(fn: Callable[[Any], object], args: Sequence[Any]) -> float:
    """Seconds per call, cycling through ``args``."""
    t0 = time.perf_counter()
    for a in args:
        fn(a)
    return (time.perf_counter() - t0) / len(args)


def build(
    instances: int, blocks: int, bs: int, prompt_tokens: int, seed: int = 0
) -> tuple[PrefixIndex, dict[str, Any]]:
    rng = random.Random(seed)
    index = PrefixIndex(bs)
    system = [rng.randrange(150_000) for _ in range(512)]
    per_prompt = prompt_tokens // bs
    prompts: dict[str, list[list[int]]] = {}
    next_hash = 1
    t0 = time.perf_counter()
    for i in range(instances):
        name = f"inst{i}"
        index.set_precise(name, True)
        prompts[name] = []
        # The system prompt once (vLLM stores a shared prefix once), then each prompt's own blocks as its child.
        sys_blocks = len(system) // bs
        sys_hashes = list(range(next_hash, next_hash + sys_blocks))
        next_hash += sys_blocks
        index.apply_stored(name, sys_hashes, None, system, bs)
        stored = sys_blocks
        while stored < blocks:
            prompt = system + [rng.randrange(150_000) for _ in range(prompt_tokens - len(system))]
            n = min(per_prompt - sys_blocks, blocks - stored)
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
            index.apply_stored(name, hashes, sys_hashes[-1], prompt[len(system) : len(system) + n * bs], bs)
            if n == per_prompt - sys_blocks:  # the last, partly stored prompt is no full hit: not a lookup
                prompts[name].append(prompt)
            stored += n
    fill_s = time.perf_counter() - t0
    distinct = sum(s["blocks"] for s in index.stats()["instances"].values())
    return index, {
        "fill_s": fill_s,
        "events_blocks": instances * blocks,
        "distinct_blocks": distinct,
        "prompts": prompts,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=50_000, help="blocks per instance")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    index, info = build(a.instances, a.blocks, a.block_size, a.prompt_tokens)
    rng = random.Random(1)
    names = list(info["prompts"])
    hits = [rng.choice(info["prompts"][rng.choice(names)]) for _ in range(a.lookups)]
    misses = [[rng.randrange(150_000) for _ in range(a.prompt_tokens)] for _ in range(min(a.lookups, 500))]
    keys = [index.block_keys(p) for p in hits]

    expect = a.prompt_tokens // a.block_size * a.block_size
    assert max(index.match(hits[0]).values()) == expect, "a stored prompt should be a full hit"
    assert max(index.match(misses[0]).values()) == 0

    cases = {
        "hit": _timeit(index.match, hits),
        "miss": _timeit(index.match, misses),
        "keys": _timeit(index.block_keys, hits),
        "hit(keys)": _timeit(index.match, keys),
    }
    print(
        f"PrefixIndex: {a.instances} instances x {a.blocks} blocks (block_size {a.block_size}), "
        f"{a.prompt_tokens}-token prompts; fill {info['events_blocks'] / info['fill_s'] / 1e3:.0f}k blocks/s "
        f"({info['distinct_blocks']} distinct entries); python {platform.python_version()}"
    )
    print(f"{'case':<10} {'µs/lookup':>10} {'lookups/s':>11}")
    for name, s in cases.items():
        print(f"{name:<10} {s * 1e6:>10.1f} {1 / s:>11,.0f}")
    if a.json:
        out = {
            "config": {k: v for k, v in vars(a).items() if k != "json"},
            "fill_blocks_per_s": info["events_blocks"] / info["fill_s"],
            "us_per_lookup": {k: v * 1e6 for k, v in cases.items()},
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
