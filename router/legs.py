"""What each leg of a request carries, and what the client gets back about usage. Pure functions over bodies.

* The client's body never steers the data plane: ``kv_transfer_params`` is the proxy's alone (removed on intake).
* The prefill leg of a transfer computes the prompt and one token: sampling constraints that would make that one
  token invalid (``min_tokens``) or expensive (structured outputs, logprobs, ``n``) are removed from it.
* Some requests cannot be split across instances at all (``n``/``best_of`` > 1 fan out into vLLM child requests
  sharing one transfer id; ``echo``/``prompt_logprobs`` need the prompt's logits on the serving instance): they are
  served on one instance.
* Usage: under P/D the decode instance reports the transferred prompt as cached. The prefill leg's own usage says
  what was really cached where the prompt was computed; the proxy puts that number in the final usage.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_disagg.transfer_params import LOAD_OUTCOME_KEY, PROOF_KEY, decode_proof, prefill_proof

# Fields the 1-token prefill leg must not carry (vLLM rejects min_tokens > max_tokens; the rest is wasted work).
_PREFILL_DROP = (
    "min_tokens",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "stream_options",
    "n",
    "best_of",
    "use_beam_search",
    "logit_bias",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)


def _count(v: Any) -> int:
    """An ``n``/``best_of`` value as vLLM's request models would coerce it (2.0 and "2" are 2); 1 otherwise."""
    if isinstance(v, bool):
        return 1
    try:
        return int(v) if isinstance(v, int | float | str) else 1
    except (TypeError, ValueError, OverflowError):
        return 1


# Request fields a KV or encoder-cache connector reads as its peer's address: only the proxy may set them.
_PEER_PARAMS = ("kv_transfer_params", "ec_transfer_params")


def take_client_kv_params(body: dict[str, Any]) -> bool:
    """Remove the connector parameters a client sent (True if the body named any, even as null): only the proxy may
    set them. vLLM copies ``vllm_xargs`` into the same ``extra_args`` the connectors read them from, so a copy there
    goes too. A body that named one is re-encoded, never forwarded as sent (a duplicate key would survive there)."""
    taken = False
    xargs = body.get("vllm_xargs")
    for key in _PEER_PARAMS:
        if key in body:
            del body[key]
            taken = True
        if isinstance(xargs, dict) and key in xargs:
            del xargs[key]
            taken = True
    return taken


def single_instance_reason(body: dict[str, Any]) -> str:
    """Why this request must be served on one instance ("" when it can be split into prefill and decode)."""
    for key in ("n", "best_of"):
        if _count(body.get(key)) > 1:
            return f"{key}_gt_1"
    if body.get("use_beam_search"):
        return "beam_search"
    if body.get("echo"):
        return "echo"
    if body.get("prompt_embeds"):
        return "prompt_embeds"  # no token ids: the connector matches and hashes prompts by their ids
    if body.get("prompt_logprobs") is not None and body.get("prompt_logprobs") is not False:
        return "prompt_logprobs"
    tool_choice = body.get("tool_choice")
    if tool_choice == "required" or isinstance(tool_choice, dict):
        return "forced_tool_choice"  # vLLM compiles it into structured outputs: not for a 1-token prefill leg
    return ""


def prefill_leg_params(transfer_id: str, secret: bytes | None) -> dict[str, Any]:
    """What the prefill leg asks of its instance: hold the prompt's KV for a decode, vouched for with the shared
    secret (an unvouched hold is kept only briefly)."""
    params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": transfer_id}
    if secret:
        params[PROOF_KEY] = decode_proof(secret, transfer_id)
    return params


def decode_leg_params(
    transfer_id: str, host: str, port: int, secret: bytes | None, forwarded_proof: object = None
) -> dict[str, Any]:
    """What the decode leg asks of its instance: load from prefill ``host:port``. With the shared secret the proxy
    vouches for that prefill itself; without it, it forwards the proof the prefill instance put in its answer
    (instances with a secret dial only vouched-for prefills)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": host,
        "remote_port": port,
    }
    if secret:
        params[PROOF_KEY] = prefill_proof(secret, transfer_id, host, port)
    elif isinstance(forwarded_proof, str) and forwarded_proof:
        params[PROOF_KEY] = forwarded_proof
    return params


def prefill_leg_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    p.update(stream=False, max_tokens=1, kv_transfer_params=kv_params)
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    return p


def prefill_usage(raw: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(usage, kv_transfer_params) of a prefill leg's JSON answer; (None, None) when it has none."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None, None
    if not isinstance(doc, dict):
        return None, None
    usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else None
    params = doc.get("kv_transfer_params") if isinstance(doc.get("kv_transfer_params"), dict) else None
    return usage, params


# What decode's usage reports of the prompt cache in the prefill leg's place: prefill computed the prompt and wrote
# it into its cache, decode loaded it (so decode alone would say nothing was cached or created).
PROMPT_CACHE_COUNTS = ("cached_tokens", "created_cache_tokens")


def prompt_cache_counts(usage: dict[str, Any] | None) -> dict[str, int] | None:
    """The ``prompt_tokens_details`` counts of ``PROMPT_CACHE_COUNTS`` in a leg's usage (None: it reports none)."""
    details = usage.get("prompt_tokens_details") if usage else None
    if not isinstance(details, dict):
        return None
    counts: dict[str, int] = {}
    for key in PROMPT_CACHE_COUNTS:
        value = details.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            counts[key] = value
    return counts or None


def _patch(doc: Any, counts: dict[str, int]) -> bool:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict):
        return False
    changed = False
    for key, value in counts.items():
        if key in details:
            details[key] = value
            changed = True
    return changed


def patch_usage_json(raw: bytes, counts: dict[str, int]) -> bytes:
    """A non-streamed answer with the prompt's real cache counts (unchanged when it reports none)."""
    if b'"prompt_tokens_details"' not in raw:
        return raw
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    return json.dumps(doc).encode() if _patch(doc, counts) else raw


def load_failed_answer(raw: bytes) -> bytes | None:
    """A decode instance's whole answer whose ``kv_transfer_params`` say its KV load failed (it computed the prompt
    itself: DisaggConnector's ``disagg_load``), with those params cleared for the client; None for any other."""
    if not has(raw, b'"' + LOAD_OUTCOME_KEY.encode() + b'"'):
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    if not isinstance(params, dict) or params.get(LOAD_OUTCOME_KEY) != "failed":
        return None
    doc["kv_transfer_params"] = None
    return json.dumps(doc).encode()


def patch_sse_usage(chunk: bytes, counts: dict[str, int]) -> bytes:
    """The same for a streamed chunk: only SSE events that carry a usage block are re-encoded."""
    if b'"prompt_tokens_details"' not in chunk:
        return chunk
    out = []
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and has(line, b'"prompt_tokens_details"'):
            cr = line.endswith(b"\r")
            try:
                doc = json.loads(line[6:])
            except ValueError:
                out.append(line)
                continue
            if _patch(doc, counts):
                line = b"data: " + json.dumps(doc).encode() + (b"\r" if cr else b"")
        out.append(line)
    return b"\n".join(out)


def split_complete_events(buffer: bytes) -> tuple[bytes, bytes]:
    """(complete SSE events, the incomplete tail): a usage event split across chunks is patched whole."""
    end = max(buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n"))
    if end < 0:
        return b"", buffer
    cut = end + (4 if buffer.startswith(b"\r\n\r\n", end) else 2)
    return buffer[:cut], buffer[cut:]


def completion_tokens(raw: bytes) -> int:
    """``usage.completion_tokens`` of a JSON answer or the last usage-bearing SSE event in ``raw`` (0 if absent)."""
    at = raw.rfind(b'"completion_tokens"')
    if at < 0:
        return 0
    digits = raw[at + len(b'"completion_tokens"') :].lstrip(b": ")
    n = 0
    for c in digits[:12]:
        if 48 <= c <= 57:
            n = n * 10 + c - 48
        else:
            break
    return n


def has(haystack: bytes, needle: bytes) -> bool:
    """``needle in haystack`` without its cost: CPython's ``bytes.__contains__`` first tries the needle as an int,
    raising and formatting a TypeError it then discards (most of what a relayed chunk's checks cost)."""
    return haystack.find(needle) >= 0


def count_sse_events(chunk: bytes) -> int:
    """Token events in a streamed chunk (one per ``data:`` line start, not counting ``[DONE]``). JSON escapes line
    breaks inside strings, so a line start is a real one; a token's text may still read ``data: [DONE]``."""
    starts = chunk.count(b"\ndata: ") + chunk.startswith(b"data: ")
    done = chunk.count(b"\ndata: [DONE]") + chunk.startswith(b"data: [DONE]")
    return starts - done
