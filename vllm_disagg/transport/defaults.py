"""The transfer engine's default settings, declared once: ``ConnectorConfig`` (which documents and validates them)
and ``EngineSettings`` both read them from here. Pure values, so the engine imports no config machinery."""

from __future__ import annotations

TRANSPORT = "auto"  # every data path that comes up here; a path's name: that one is required
LEASE_S = 30.0  # prefill keeps blocks this long without word from decode
UNVOUCHED_LEASE_S = (
    5.0  # ... or this long, until a decode claims them, for a hold nobody with the secret asked for
)
LOAD_TIMEOUT_S = 30.0  # decode gives up on a load that has not finished (or progressed) this long
HEARTBEAT_S = 1.0  # decode keeps prefill's lease alive at this interval
CONNECT_TIMEOUT_S = 5.0  # handshake deadline for a new peer
VERIFY_CHECKSUMS = False  # TCP: CRC32 per block
# prefill: offers are sent at most once per this window (a quiet spell, the last layer, a forward pass's end: at once)
OFFER_BATCH_MS = 2.0
# prefill: offers holding fewer bytes than this together wait for the step's last layer, the forward pass's end or
# this many bytes instead of leaving every window (a message of a few KiB per layer costs both sides' I/O threads a
# wake-up each; the tail it adds is at most this many bytes on the wire)
OFFER_HOLD_BYTES = 256 << 10
