"""Proofs of the shared secret: an HMAC-SHA256 over a message's own text, compared in constant time.

One place for the side channel's handshake and proxy messages (``wire``) and for ``kv_transfer_params``
(``transfer_params``), so every proof is made and checked the same way. Pure logic.
"""

from __future__ import annotations

import hashlib
import hmac


def make(secret: bytes | None, text: str) -> str:
    """The hex proof of ``text`` under ``secret``; "" without a secret."""
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest() if secret else ""


def matches(want: str, given: str) -> bool:
    """Whether ``given`` is the proof ``want``. Bytes are compared: compare_digest refuses non-ASCII str, and a
    client or peer may send anything."""
    return hmac.compare_digest(want.encode(), given.encode("utf-8", "replace"))
