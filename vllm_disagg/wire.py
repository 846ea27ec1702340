"""Side-channel and data-plane messages between a decode (D) and a prefill (P) instance.

Typed msgspec structs in a tagged union, msgpack-encoded, versioned by ``WIRE_VERSION``: nothing on the wire is
unpickled, unknown or malformed input is rejected with a reason, and a peer speaking another version is refused.

Frames on one ZMQ connection (D's DEALER -> P's ROUTER):
    [MAGIC, encoded message]                       control messages, both directions
    [MAGIC, encoded LayerBlocks, frame_0, ...]     data, P -> D: one layer's blocks back to back in a few frames
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from vllm_disagg import proof
from vllm_disagg.kv_layout import KVGeometry

# 2: HelloAck proof and NIXL agent, Register prompt hash, Heartbeat queued ids, block stride.
# 3: Hello offers data paths generically (``data_paths``), HelloAck names the one prefill chose; no NIXL fields.
# 4: a LayerBlocks payload frame may hold several blocks back to back (a run, or a gathered layer), not one each.
# 5: LayerBlocks.block_indices is packed little-endian int32 (bytes), read as an array without a Python list;
#    LayerBlocks.layer_count: one message may carry the same blocks of several consecutive layers.
# 6: Posted: prefill announces the direct writes it started.
# 7: with a shared secret, decode offers a path that writes into its memory by name until prefill proved the secret.
# 8: Abort.writes_stopped: only that Abort lets a decode reuse blocks a prefill may still be writing into.
WIRE_VERSION = 8
MAGIC = b"VDKV1"
MAX_CONTROL_BYTES = 1 << 20  # a control message larger than 1 MiB is malformed by definition
# A layer message's payload frame holds at most max(MAX_FRAME_BYTES, block_bytes): decode sizes its socket's
# message limit by it, and a long layer is sent as several frames (which zmq pipelines).
MAX_FRAME_BYTES = 8 << 20


class PathOffer(msgspec.Struct, frozen=True, kw_only=True):
    """A data path a decode can receive on, with what prefill needs to use it (opaque here: the path's own
    module encodes and checks ``info``; the TCP path needs none)."""

    name: str
    info: bytes = b""


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    """D -> P, once per connection, before any registration."""

    wire_version: int
    connector_version: str
    engine_id: str
    geometry: KVGeometry
    nonce: str
    ts: float
    auth: str = ""  # hex HMAC-SHA256(secret, "hello|engine_id|nonce|ts"), empty when no secret is configured
    data_paths: list[PathOffer] = msgspec.field(
        default_factory=lambda: [PathOffer(name="tcp")]
    )  # what decode can receive on, preferred first


class HelloAck(msgspec.Struct, tag="hello_ack", kw_only=True):
    engine_id: str
    geometry: KVGeometry
    data_path: str = "tcp"  # the data path prefill chose among decode's offers
    data_path_info: bytes = b""  # what decode needs to trust that path's completions (NIXL: prefill's agent)
    auth: str = (
        ""  # HMAC-SHA256(secret, "ack|engine_id|<decode's hello nonce>"): prefill knows the secret too
    )


class Refuse(msgspec.Struct, tag="refuse", kw_only=True):
    """P -> D: the handshake (or a message) is refused. ``field`` names what differs, for humans and logs."""

    reason: str
    field: str = ""
    ours: str = ""
    theirs: str = ""


class Register(msgspec.Struct, tag="register", kw_only=True):
    """D -> P: send transfer ``transfer_id``'s blocks [first_block, first_block + num_blocks) here.

    D already holds the blocks before ``first_block`` (its own prefix cache), so they are not sent.
    """

    transfer_id: str
    request_id: str
    first_block: int
    num_blocks: int
    prompt_len: int
    dest_blocks: list[int] = msgspec.field(default_factory=list)  # decode's block ids (NIXL writes into them)
    prompt_hash: str = ""  # of the prompt's token ids: equal lengths are not enough to prove the same prompt


class Describe(msgspec.Struct, tag="describe", kw_only=True):
    """Proxy -> instance: what KV geometry do you have? Lets a router refuse incompatible pairs before traffic.

    Authenticated like Hello (same HMAC over "hello|engine_id|nonce|ts") when the instance requires a secret.
    """

    engine_id: str
    nonce: str
    ts: float
    auth: str = ""


class Release(msgspec.Struct, tag="release", kw_only=True):
    """Proxy -> prefill: the proxy gave up on transfer ``transfer_id`` (its decode failed, the client left, a deadline
    passed) and no decode will load it: free its blocks now, not when the lease runs out. A transfer a decode has
    registered is that decode's to end, so prefill ignores this for it. Authenticated like Describe, with the proof
    bound to the transfer id."""

    transfer_id: str
    reason: str
    engine_id: str
    nonce: str
    ts: float
    auth: str = ""


class Description(msgspec.Struct, tag="description", kw_only=True):
    engine_id: str
    geometry: KVGeometry
    connector_version: str
    data_paths: list[str]


class Heartbeat(msgspec.Struct, tag="heartbeat", kw_only=True):
    """D -> P: still waiting for these transfers; extend their leases."""

    transfer_ids: list[str]
    queued: list[str] = msgspec.field(
        default_factory=list
    )  # requests still queued on decode: extend, never abort


class Done(msgspec.Struct, tag="done", kw_only=True):
    """D -> P: every block of every layer arrived (``ok``) or D gave up / was aborted (not ``ok``): free them."""

    transfer_id: str
    ok: bool
    reason: str = ""


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    """P -> D: this transfer will never complete (aborted on P, lease lost, unknown); recompute.

    ``writes_stopped``: no write of this transfer can land in decode's memory any more. On a path that writes into
    decode's cache, decode hands a failed load's blocks back to vLLM only on such an Abort (the answer to its
    Done(not ok)): a plain Abort may leave while writes are still in flight."""

    transfer_id: str
    reason: str
    writes_stopped: bool = False


class Posted(msgspec.Struct, tag="posted", kw_only=True):
    """P -> D: prefill started ``writes`` more direct writes (NIXL WRITEs) into decode's cache for this transfer;
    each one's notice follows its data. A direct path's notices wake nothing on decode, so decode polls for them
    quickly only while writes it was told of have not landed, and slowly otherwise."""

    transfer_id: str
    writes: int


INDEX_DTYPE = np.dtype("<i4")  # a packed block index on the wire


def pack_indices(indices: Sequence[int] | np.ndarray) -> bytes:
    """Logical block indices as ``LayerBlocks.block_indices`` carries them (little-endian int32)."""
    return np.asarray(indices, dtype=np.int64).astype(INDEX_DTYPE).tobytes()


class LayerBlocks(msgspec.Struct, tag="layer", kw_only=True):
    """P -> D data header: the following frames hold blocks ``block_indices`` (logical, in the request) of layers
    ``layer`` .. ``layer + layer_count - 1``, layer by layer, each layer's blocks back to back in that order; each
    frame is a whole number of blocks (one run, or a gathered batch), so a layer costs a few frames however many
    blocks it has. The indices are packed (``pack_indices``): a layer of any length costs one bytes field to
    encode and one array view to read, not a Python int per block. Several layers go in one message when prefill
    had them ready together (its I/O thread was busy while they were computed)."""

    transfer_id: str
    layer: int
    block_indices: bytes
    block_bytes: int
    layer_count: int = 1
    crc32: list[int] = msgspec.field(
        default_factory=list
    )  # per block and layer, when the sender verifies integrity

    def indices(self) -> np.ndarray:
        """``block_indices`` as a read-only int32 array (decode has checked its length is whole indices)."""
        return np.frombuffer(self.block_indices, dtype=INDEX_DTYPE)

    @property
    def num_blocks(self) -> int:
        return len(self.block_indices) // INDEX_DTYPE.itemsize


Message = (
    Hello
    | HelloAck
    | Refuse
    | Register
    | Heartbeat
    | Done
    | Abort
    | LayerBlocks
    | Describe
    | Description
    | Posted
    | Release
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class WireError(ValueError):
    """A frame that is not a valid message of this wire version."""


def encode(msg: Message) -> list[bytes]:
    return [MAGIC, _encoder.encode(msg)]


def decode(frames: Sequence[bytes | memoryview]) -> tuple[Message, list[bytes | memoryview]]:
    """Decode ``[MAGIC, message, *payload]``; returns the message and the payload frames (data blocks)."""
    if len(frames) < 2:
        raise WireError(f"expected at least 2 frames, got {len(frames)}")
    if bytes(frames[0]) != MAGIC:
        raise WireError(f"bad magic/version {bytes(frames[0])[:8]!r} (want {MAGIC!r})")
    body = frames[1]
    if len(body) > MAX_CONTROL_BYTES:
        raise WireError(f"control message of {len(body)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        msg = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable message: {exc}") from None
    payload = list(frames[2:])
    if payload and not isinstance(msg, LayerBlocks):
        raise WireError(f"{type(msg).__name__} carries {len(payload)} unexpected payload frames")
    if isinstance(msg, LayerBlocks):
        _check_indices(msg)
        _check_layer_frames(msg, payload)
    return msg, payload


def _check_indices(msg: LayerBlocks) -> None:
    if len(msg.block_indices) % INDEX_DTYPE.itemsize:
        raise WireError(f"block indices of {len(msg.block_indices)} bytes are not whole int32 values")
    if msg.layer_count < 1:
        raise WireError(f"layer count {msg.layer_count} (at least 1)")


def _check_layer_frames(msg: LayerBlocks, payload: list[bytes | memoryview]) -> None:
    """The payload holds exactly the header's blocks of every layer it names: frames of whole blocks adding up to
    all of them (zero-byte blocks: one empty frame each)."""
    n, bb = msg.num_blocks * msg.layer_count, msg.block_bytes
    if bb <= 0:
        if bb < 0 or len(payload) != n or any(len(f) for f in payload):
            raise WireError(f"layer header names {n} blocks of {bb} bytes but {len(payload)} frames follow")
        return
    total = 0
    for frame in payload:
        size = len(frame)
        if size == 0 or size % bb:
            raise WireError(f"block frame of {size} bytes is not a whole number of {bb}-byte blocks")
        total += size
    if total != n * bb:
        raise WireError(f"layer header names {n} blocks ({n * bb} bytes) but the frames hold {total} bytes")


def block_views(frames: Sequence[Any], block_bytes: int) -> Iterator[memoryview]:
    """Each block of a layer message's frames, in order (a frame holds one or more blocks back to back)."""
    for f in frames:
        mv = memoryview(f).cast("B")
        for a in range(0, len(mv), block_bytes):
            yield mv[a : a + block_bytes]


_layer_decoder = msgspec.msgpack.Decoder(LayerBlocks)


def peek_transfer_id(frames: Sequence[bytes | memoryview]) -> str | None:
    """The transfer a malformed data message was about (so its load can fail at once), if the header decodes."""
    if len(frames) < 2 or bytes(frames[0]) != MAGIC or len(frames[1]) > MAX_CONTROL_BYTES:
        return None
    try:
        return _layer_decoder.decode(frames[1]).transfer_id
    except msgspec.DecodeError:
        return None


def decode_layer_notice(body: bytes) -> LayerBlocks:
    """Decode a data path's notice (NIXL: a WRITE's notification): a LayerBlocks header whose blocks were written
    directly into decode's cache (no payload frames)."""
    if len(body) > MAX_CONTROL_BYTES:
        raise WireError(f"notification of {len(body)} bytes exceeds {MAX_CONTROL_BYTES}")
    try:
        msg = _layer_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"undecodable data-path notice: {exc}") from None
    _check_indices(msg)
    return msg


def hello_auth(secret: bytes | None, engine_id: str, nonce: str, ts: float) -> str:
    return proof.make(secret, f"hello|{engine_id}|{nonce}|{ts:.6f}")


def release_auth(secret: bytes | None, engine_id: str, transfer_id: str, nonce: str, ts: float) -> str:
    return proof.make(secret, f"release|{engine_id}|{transfer_id}|{nonce}|{ts:.6f}")


def hello_ack_auth(secret: bytes | None, engine_id: str, nonce: str) -> str:
    return proof.make(secret, f"ack|{engine_id}|{nonce}")


def check_hello_ack_auth(secret: bytes | None, ack: HelloAck, nonce: str) -> str:
    """Decode's check that the prefill it dialled knows the secret (bound to decode's own fresh nonce)."""
    if not secret:
        return ""
    want = hello_ack_auth(secret, ack.engine_id, nonce)
    if not proof.matches(want, ack.auth):
        return "prefill did not prove it knows the shared secret"
    return ""


def make_hello(
    secret: bytes | None,
    engine_id: str,
    geometry: KVGeometry,
    connector_version: str,
    now: float | None = None,
    data_paths: list[PathOffer] | None = None,
) -> Hello:
    ts = time.time() if now is None else now
    nonce = os.urandom(12).hex()
    return Hello(
        wire_version=WIRE_VERSION,
        connector_version=connector_version,
        engine_id=engine_id,
        geometry=geometry,
        nonce=nonce,
        ts=ts,
        auth=hello_auth(secret, engine_id, nonce, ts),
        data_paths=data_paths if data_paths is not None else [PathOffer(name="tcp")],
    )


def make_describe(secret: bytes | None, engine_id: str, now: float | None = None) -> Describe:
    ts = time.time() if now is None else now
    nonce = os.urandom(12).hex()
    return Describe(engine_id=engine_id, nonce=nonce, ts=ts, auth=hello_auth(secret, engine_id, nonce, ts))


def make_release(
    secret: bytes | None, engine_id: str, transfer_id: str, reason: str, now: float | None = None
) -> Release:
    ts = time.time() if now is None else now
    nonce = os.urandom(12).hex()
    auth = release_auth(secret, engine_id, transfer_id, nonce, ts)
    return Release(transfer_id=transfer_id, reason=reason, engine_id=engine_id, nonce=nonce, ts=ts, auth=auth)


def check_hello_auth(
    secret: bytes | None,
    hello: Hello | Describe | Release,
    max_skew_s: float = 300.0,
    now: float | None = None,
) -> str:
    """Empty string when the hello is acceptable, else the reason it is refused."""
    if not secret:
        return ""
    if not hello.auth:
        return (
            "peer sent no shared-secret proof (set the same shared_secret / VLLM_DISAGG_SECRET on both sides)"
        )
    if (
        not isinstance(hello.ts, float | int)
        or not abs((time.time() if now is None else now) - hello.ts) <= max_skew_s
    ):
        return f"hello timestamp off by more than {max_skew_s:.0f} s (clock skew or replay)"
    if isinstance(hello, Release):
        want = release_auth(secret, hello.engine_id, hello.transfer_id, hello.nonce, hello.ts)
    else:
        want = hello_auth(secret, hello.engine_id, hello.nonce, hello.ts)
    if not proof.matches(want, hello.auth):
        return "shared-secret proof does not match (different shared_secret on the two sides)"
    return ""
