"""The prefix token cache: checkpoints at word boundaries, the longest held prefix found, bounded by bytes."""

from __future__ import annotations

import random

import pytest

from vllm_disagg.router.token_cache import PrefixTokenCache

WORDS = ["alpha", "beta", "gamma,", "delta.", "42", "(x)"]


def _text(seed: int, chars: int) -> str:
    rnd = random.Random(seed)
    out = ""
    while len(out) < chars:
        out += (" " if out else "") + rnd.choice(WORDS)
    return out


def test_checkpoints_end_before_a_space_that_follows_a_word_in_each_step() -> None:
    cache = PrefixTokenCache(step_chars=100, max_chars=1_000)
    text = _text(1, 2_000)
    points = cache.checkpoints(text, 0, len(text))
    assert points == sorted(points) and 8 <= len(points) <= 10  # one per step, up to max_chars
    for c in points:
        assert text[c] == " " and not text[c - 1].isspace() and c <= 1_000
    assert all(lo < c < hi for lo, hi in [(250, 700)] for c in cache.checkpoints(text, 250, 700))
    # a run of spaces offers no checkpoint inside it: a cut there would split the run
    assert cache.checkpoints("a" * 60 + "  " + "b" * 100, 0, 162) == []


def test_the_longest_held_prefix_is_found_and_only_for_the_same_text() -> None:
    cache = PrefixTokenCache(step_chars=100, max_chars=1_000)
    text = _text(2, 1_000)
    points = cache.checkpoints(text, 0, len(text))
    for i, c in enumerate(points[:4]):
        cache.store(text, True, c, list(range(i + 1)))
    assert cache.lookup(text, True, points) == (points[3], [0, 1, 2, 3])
    assert cache.lookup(text, False, points) is None  # ids with special tokens are not the plain text's
    other = text[: points[1]] + " changed" + text[points[1] + 8 :]  # the same up to the second checkpoint
    assert cache.lookup(other, True, cache.checkpoints(other, 0, len(other))) == (points[1], [0, 1])
    assert cache.hits == 2 and cache.misses == 1


def test_the_cache_is_bounded_by_the_bytes_of_ids_it_holds() -> None:
    cache = PrefixTokenCache(step_chars=100, max_chars=1_000, max_bytes=4 * 1_000)
    texts = [_text(10 + i, 300) for i in range(20)]
    for t in texts:
        c = cache.checkpoints(t, 0, len(t))[0]
        cache.store(t, True, c, list(range(300)))  # 1,200 bytes each: three fit
    assert len(cache) == 3
    last = texts[-1]
    assert cache.lookup(last, True, cache.checkpoints(last, 0, len(last))) is not None  # the newest stay
    first = texts[0]
    assert cache.lookup(first, True, cache.checkpoints(first, 0, len(first))) is None


def test_bad_steps_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefixTokenCache(step_chars=1)
    with pytest.raises(ValueError):
        PrefixTokenCache(step_chars=200, max_chars=100)
