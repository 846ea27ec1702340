"""Token ids of prompt prefixes seen lately, so a prompt that repeats one (a system prompt, a chat's history, a shared
document) is tokenized only past it.

A tokenizer that splits words at spaces (``PromptTokenizer.splits_at_spaces``) gives a text's ids as the ids of
its pieces joined, where each piece after the first starts with a space that follows a word. Prompts are cut at
checkpoints (the last such space before every ``step_chars`` characters, up to ``max_chars``), and the ids up to each
checkpoint are kept under the prefix's length and hash: the next prompt that shares the prefix up to a checkpoint
starts from there. Pure (no I/O); the proxy holds one per process. Bounded by the bytes of ids it holds (least
recently used first out).
"""

from __future__ import annotations

import array
from collections import OrderedDict

Key = tuple[bool, int, int]  # (special tokens added, prefix length in characters, the prefix's hash)


def follows_word(text: str, c: int) -> bool:
    """Whether ``text`` can be cut at ``c`` with the ids of both sides joined being the whole's (for a tokenizer that
    splits words at spaces): ``text[c]`` is a space and the character before it is not whitespace."""
    return 0 < c < len(text) and text[c] == " " and not text[c - 1].isspace()


class PrefixTokenCache:
    def __init__(self, step_chars: int = 1024, max_chars: int = 16_384, max_bytes: int = 32 << 20) -> None:
        if step_chars < 2 or max_chars < step_chars:
            raise ValueError(f"step_chars {step_chars} must be >= 2 and <= max_chars {max_chars}")
        self.step_chars = step_chars
        self.max_chars = max_chars
        self.max_bytes = max_bytes
        self._ids: OrderedDict[Key, array.array[int]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def checkpoints(self, text: str, lo: int, hi: int) -> list[int]:
        """The checkpoints of ``text`` strictly between ``lo`` and ``hi`` (and within ``max_chars``), rising: for
        every multiple of ``step_chars``, the last space in the half step before it that follows a word."""
        step, out = self.step_chars, []
        end = min(hi, self.max_chars + 1)
        for mark in range((lo // step + 1) * step, end, step):
            c = text.rfind(" ", mark - step // 2, mark)
            if lo < c < hi and follows_word(text, c):
                out.append(c)
        return out

    def lookup(self, text: str, special: bool, points: list[int]) -> tuple[int, list[int]] | None:
        """The longest of ``points`` (checkpoints of ``text``) whose prefix's ids are held, with them."""
        for c in reversed(points):
            key = (special, c, hash(text[:c]))
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                self.hits += 1
                return c, ids.tolist()
        if points:
            self.misses += 1
        return None

    def store(self, text: str, special: bool, cut: int, ids: list[int]) -> None:
        """Hold the ids of ``text[:cut]`` (``cut`` one of its checkpoints)."""
        key = (special, cut, hash(text[:cut]))
        if key in self._ids:
            self._ids.move_to_end(key)
            return
        held = array.array("i", ids)
        self._ids[key] = held
        self._bytes += held.itemsize * len(held)
        while self._bytes > self.max_bytes and self._ids:
            _, old = self._ids.popitem(last=False)
            self._bytes -= old.itemsize * len(old)

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._ids)
