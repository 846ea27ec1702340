"""``kv_transfer_params`` as DisaggConnector accepts them: parsed by type and range before anything acts on them.

vLLM's OpenAI server passes a request's ``kv_transfer_params`` to the connector unchecked, so every field is
client input. A bad value must fail that request's transfer alone (it is then served locally), never raise inside
vLLM's scheduler (that kills the engine) or reach a socket call (that killed the transfer thread). Pure logic.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from vllm_disagg import proof as proof_of

MAX_TRANSFER_ID = 128
# In a decode instance's whole (non-streamed) answer, ``kv_transfer_params[LOAD_OUTCOME_KEY] == "failed"``: its load
# of the prompt's KV failed and the prompt was computed there instead (the proxy reports the fallback).
LOAD_OUTCOME_KEY = "disagg_load"
# With a shared secret, ``kv_transfer_params[PROOF_KEY]`` vouches for the rest: an HMAC over the transfer id (and, for
# decode, the prefill to dial) by someone who holds the secret (the proxy, or the prefill instance that answered).
PROOF_KEY = "disagg_proof"
_MAX_PROOF = 128
_TRANSFER_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # fullmatch: no trailing newline slips through
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


class TransferParamsError(ValueError):
    """A field of ``kv_transfer_params`` is unusable; the message names it and what is allowed."""


@dataclass(frozen=True)
class RemoteDecode:
    """This instance prefills; decode will fetch the prompt's KV under ``transfer_id``."""

    transfer_id: str
    proof: str = ""

    def vouched(self, secret: bytes | None) -> bool:
        """Whether someone holding ``secret`` asked for this hold (always, without a secret)."""
        return _proof_ok(secret, self.proof, decode_proof(secret, self.transfer_id))


@dataclass(frozen=True)
class RemotePrefill:
    """This instance decodes; it loads the prompt's KV from ``host:port`` under ``transfer_id``."""

    transfer_id: str
    host: str
    port: int
    proof: str = ""

    def vouched(self, secret: bytes | None) -> bool:
        """Whether someone holding ``secret`` named this prefill (always, without a secret)."""
        return _proof_ok(secret, self.proof, prefill_proof(secret, self.transfer_id, self.host, self.port))


def decode_proof(secret: bytes | None, transfer_id: str) -> str:
    """``PROOF_KEY`` for a prefill leg: hold this transfer's KV for a decode ("" without a secret)."""
    return proof_of.make(secret, f"kvp|hold|{transfer_id}")


def prefill_proof(secret: bytes | None, transfer_id: str, host: str, port: int) -> str:
    """``PROOF_KEY`` for a decode leg: load this transfer from ``host:port`` ("" without a secret)."""
    return proof_of.make(secret, f"kvp|load|{transfer_id}|{host.strip('[]')}|{port}")


def _proof_ok(secret: bytes | None, proof: str, want: str) -> bool:
    if not secret:
        return True
    return bool(proof) and proof_of.matches(want, proof)


def _proof(params: dict[str, Any]) -> str:
    value = params.get(PROOF_KEY)
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > _MAX_PROOF:
        raise TransferParamsError(f"{PROOF_KEY} must be a string of at most {_MAX_PROOF} characters")
    return value


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TransferParamsError(f"{key} must be true or false, got {type(value).__name__}")
    return value


def _transfer_id(params: dict[str, Any], required: bool) -> str | None:
    tid = params.get("transfer_id")
    if tid is None:
        if required:
            raise TransferParamsError("transfer_id is required with do_remote_prefill")
        return None
    if not isinstance(tid, str) or not _TRANSFER_ID.fullmatch(tid):
        raise TransferParamsError(
            f"transfer_id must be 1-{MAX_TRANSFER_ID} characters of [A-Za-z0-9._:@/+=-], got {str(tid)[:40]!r}"
        )
    return tid


def valid_host(host: object) -> bool:
    if not isinstance(host, str) or not host:
        return False
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return bool(_HOSTNAME.fullmatch(host))


def _port(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TransferParamsError(f"remote_port must be an integer in 1..65535, got {type(value).__name__}")
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()) or len(value) > 5:
            raise TransferParamsError(f"remote_port must be an integer in 1..65535, got {value[:20]!r}")
        value = int(value)
    if not 1 <= value <= 65535:
        raise TransferParamsError(f"remote_port must be in 1..65535, got {value}")
    return value


def parse_transfer_params(params: object) -> RemoteDecode | RemotePrefill | None:
    """The role a request asks this instance to play, or None (plain local request).

    Raises :class:`TransferParamsError` naming the bad field; the caller serves the request locally.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        raise TransferParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    remote_decode = _flag(params, "do_remote_decode")
    remote_prefill = _flag(params, "do_remote_prefill")
    if remote_decode and remote_prefill:
        raise TransferParamsError("do_remote_decode and do_remote_prefill cannot both be true")
    if remote_prefill:
        tid = _transfer_id(params, required=True)
        assert tid is not None
        host = params.get("remote_host")
        if not valid_host(host):
            raise TransferParamsError(f"remote_host must be a hostname or IP address, got {str(host)[:64]!r}")
        assert isinstance(host, str)
        port = _port(params.get("remote_port"))
        return RemotePrefill(transfer_id=tid, host=host.strip("[]"), port=port, proof=_proof(params))
    if remote_decode:
        tid = _transfer_id(params, required=False)
        return RemoteDecode(transfer_id=tid or "", proof=_proof(params))
    return None


def host_allowed(host: str, allowlist: list[str] | None) -> bool:
    """``allowlist`` entries are hostnames or CIDR networks; None allows every host."""
    if allowlist is None:
        return True
    for entry in allowlist:
        if entry == host:
            return True
        try:
            if ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False
