"""Validated settings of DisaggConnector (the ``kv_connector_extra_config`` dict).

Validation happens when vLLM constructs the connector, i.e. at server start-up: a typo in a key or a bad value
stops the server with a message naming the key and what is allowed, instead of surfacing at the first request.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vllm_disagg.transport import defaults

SECRET_ENV = "VLLM_DISAGG_SECRET"


class ConnectorConfigError(ValueError):
    """``kv_connector_extra_config`` is invalid; the message names each bad key and the allowed values."""


class ConnectorConfig(BaseModel):
    """Settings for DisaggConnector, passed as ``kv_connector_extra_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: str = Field(
        defaults.TRANSPORT,
        description="KV data path: nixl (UCX), tcp (pyzmq), or auto = nixl when importable "
        "(any path registered in vllm_disagg/transport/paths.py)",
    )
    side_channel_host: str = Field("0.0.0.0", description="address the side channel binds")
    side_channel_port: int = Field(5700, ge=1, le=65535, description="side-channel port (+ TP rank)")
    advertise_host: str | None = Field(
        None,
        description="host peers should dial; default: this machine's primary address (127.0.0.1 only on a host "
        "with no route out, where peers must then be local)",
    )
    shared_secret: str | None = Field(
        None, description=f"peers must prove they know it (HMAC); default: env {SECRET_ENV}"
    )
    lease_s: float = Field(
        defaults.LEASE_S, gt=0, description="prefill keeps blocks this long without word from decode"
    )
    unvouched_lease_s: float = Field(
        defaults.UNVOUCHED_LEASE_S,
        gt=0,
        description=(
            "with a shared_secret: how long prefill holds a prompt's KV for a do_remote_decode that carries no "
            "proof from the secret (a router without it, or a client calling this instance directly) before a "
            "decode, which proved the secret, registers or heartbeats for it; then lease_s applies"
        ),
    )
    load_timeout_s: float = Field(
        defaults.LOAD_TIMEOUT_S, gt=0, description="decode stops waiting for KV after this and recomputes"
    )
    heartbeat_s: float = Field(
        defaults.HEARTBEAT_S, gt=0, description="decode keeps prefill's lease alive at this interval"
    )
    connect_timeout_s: float = Field(
        defaults.CONNECT_TIMEOUT_S, gt=0, description="handshake deadline for a new peer"
    )
    trace_path: str | None = Field(
        None, description="append one JSON line per finished transfer to this file"
    )

    decode_only: bool = Field(
        False,
        description=(
            "this instance never prefills for a transfer (kv_role kv_consumer): its per-layer save hooks are unused, "
            "so vLLM keeps FULL CUDA graphs instead of PIECEWISE"
        ),
    )
    allowed_prefill_hosts: list[str] | None = Field(
        None,
        description=(
            "decode dials only these prefill hosts (names or CIDR networks, e.g. ['10.0.0.0/8']); "
            "default: any host a request's kv_transfer_params name"
        ),
    )
    verify_checksums: bool = Field(
        defaults.VERIFY_CHECKSUMS,
        description="TCP: CRC32 per block, checked before decode uses it (costs CPU; TCP already checksums)",
    )
    offer_batch_ms: float = Field(
        defaults.OFFER_BATCH_MS,
        ge=0,
        le=100,
        description=(
            "prefill: layers computed within this window of the last send go out together (one TCP message "
            "for a step's consecutive layers); a layer after a quiet spell (unless the offers gathering hold "
            "under offer_hold_bytes), the model's last layer and the end of each forward pass go at once, so the "
            "transfer's tail does not wait. 0: each layer is sent as soon as the I/O thread reads it (no hold)"
        ),
    )

    offer_hold_bytes: int = Field(
        defaults.OFFER_HOLD_BYTES,
        ge=0,
        description=(
            "prefill: offered layers that together hold fewer bytes than this are not sent each offer window but "
            "wait for the step's last layer, the forward pass's end or this many bytes (a message of a few KiB per "
            "layer costs a wake-up on both sides; the tail it adds is at most this many bytes on the wire). "
            "0: every window sends"
        ),
    )

    staging_budget_mb: int = Field(
        1024,
        ge=1,
        description=(
            "prefill on CUDA over TCP: pinned host memory for staged KV copies (gathered, not yet sent or still "
            "read by zmq); past it a gather waits until its layer is sent and earlier copies came back (the "
            "lowest layer still to send never waits); each transfer may always hold 16 MiB more, so one whose "
            "decode is ready keeps streaming"
        ),
    )

    @field_validator("transport")
    @classmethod
    def _registered_path(cls, value: str) -> str:
        """The registry of data paths is the one list of names: a new path is accepted here without an edit."""
        from vllm_disagg.transport.paths import DATA_PATHS

        if value != "auto" and value not in DATA_PATHS:
            raise ValueError(f"not a data path; allowed: auto, {', '.join(DATA_PATHS)}")
        return value

    def secret(self) -> bytes | None:
        value = self.shared_secret if self.shared_secret is not None else os.environ.get(SECRET_ENV)
        return value.encode() if value else None

    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.side_channel_host not in WILDCARD_HOSTS:
            return self.side_channel_host
        return primary_ip()

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as exc:
            raise ConnectorConfigError(describe_errors(exc)) from None


def describe_errors(exc: ValidationError) -> str:
    fields = ConnectorConfig.model_fields
    lines = ["invalid kv_connector_extra_config for DisaggConnector:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"  unknown key {key!r}; allowed keys: {', '.join(sorted(fields))}")
        else:
            desc = fields[key].description if key in fields else ""
            lines.append(f"  {key}={err.get('input')!r}: {err['msg']}" + (f" ({desc})" if desc else ""))
    return "\n".join(lines)


# a side channel bound to one of these is reached at the primary address
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def primary_ip() -> str:
    """The address of the interface that routes outward (no packet is sent); 127.0.0.1 if there is none."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: connect() on UDP only picks a route.
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()
