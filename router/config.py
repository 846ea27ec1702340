"""Proxy settings: command-line flags, a YAML/JSON file, and ``VLLM_DISAGG_PROXY_*`` environment overrides."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vllm_disagg.policy.cost_model import CostModelConfig

ENV_PREFIX = "VLLM_DISAGG_PROXY_"
_COST_DEFAULTS = CostModelConfig()


def _blank(text: str) -> bool:
    """Whether ``text`` holds whitespace or control characters (never part of a host or URL the proxy dials)."""
    return any(ch.isspace() or not ch.isprintable() for ch in text)


class InstanceConfig(BaseModel):
    """One vLLM instance behind the proxy."""

    model_config = ConfigDict(extra="forbid")

    url: str
    role: Literal["prefill", "decode", "both"] = "both"
    id: str = ""
    side_channel: str | None = Field(
        None, description="host:port of its DisaggConnector side channel (required to prefill for a transfer)"
    )
    kv_events: str | None = Field(
        None, description="ZMQ endpoint of its KV-cache events, e.g. tcp://host:5557"
    )
    kv_events_replay: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname or _blank(v):
            raise ValueError(f"instance url must be http(s)://host:port, got {v!r}")
        try:
            parts.port  # noqa: B018 (raises for a port that is not a number in 0-65535)
        except ValueError:
            raise ValueError(f"instance url {v!r}: the port must be a number in 1-65535") from None
        return v.rstrip("/")

    @field_validator("side_channel")
    @classmethod
    def _side_channel(cls, v: str | None) -> str | None:
        if v is None:
            return None
        host, sep, port = v.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536 or _blank(host):
            raise ValueError(
                f"side_channel must be HOST:PORT (the instance's DisaggConnector side_channel_port, 1-65535), "
                f"got {v!r}"
            )
        return v

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("tcp://") or ":" not in v[6:] or _blank(v)):
            raise ValueError(f"a KV events endpoint must be tcp://HOST:PORT, got {v!r}")
        return v

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if any(not ch.isprintable() for ch in v) or len(v) > 200:
            raise ValueError(f"instance id must be printable and at most 200 characters, got {v[:60]!r}")
        return v

    def instance_id(self) -> str:
        return self.id or urlsplit(self.url).netloc

    def side_channel_addr(self) -> tuple[str, int] | None:
        if not self.side_channel:
            return None
        host, _, port = self.side_channel.rpartition(":")
        return (host or urlsplit(self.url).hostname or "127.0.0.1", int(port))

    @classmethod
    def parse(cls, spec: str, role: str | None) -> InstanceConfig:
        """``URL[;side=HOST:PORT][;events=tcp://...][;replay=tcp://...][;id=NAME]`` (the CLI form); without a
        ``role`` (an instances file's entry) also ``[;role=prefill|decode|both]``."""
        url, *opts = spec.split(";")
        fields: dict[str, Any] = {"url": url, "role": role or "both"}
        names = {"side": "side_channel", "events": "kv_events", "replay": "kv_events_replay", "id": "id"}
        if role is None:
            names["role"] = "role"
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in names:
                raise ValueError(f"unknown instance option {key!r} in {spec!r}; allowed: {', '.join(names)}")
            if key == "side" and ":" not in value:
                value = f"{urlsplit(url).hostname}:{value}"
            fields[names[key]] = value
        return cls(**fields)


class ProxySettings(BaseModel):
    """Every proxy setting, declared once: ``vllm-disagg proxy`` makes a flag of each scalar field (its description
    is the flag's help), a config file and ``VLLM_DISAGG_PROXY_<NAME>`` set the same fields."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, description="port to listen on")
    instances: list[InstanceConfig] = Field(default_factory=list)
    instances_file: str | None = Field(
        None, description="YAML/JSON list of instances, re-read when it changes"
    )
    tokenizer: str | None = Field(
        None, description="local tokenizer dir; default: ask an instance's /tokenize"
    )
    k8s_namespace: str | None = Field(
        None, description="discover instances from Ready pods in this namespace"
    )
    k8s_selector: str = Field(
        "app.kubernetes.io/part-of=vllm-disagg",
        description="label selector of the pods to discover (role from the label vllm-disagg/role)",
    )
    policy: str = Field(
        "cost",
        description="cost | round-robin | least-loaded | always-transfer | module:Class | file.py:Class",
    )
    policy_args: str = Field(
        "",
        description="the policy constructor's keyword arguments as a JSON object, e.g. '{\"threshold_tokens\": 512}' "
        "(for cost or a subclass of it: CostModelConfig fields)",
    )
    admin_key: str | None = Field(
        None,
        description="key for the admin API (header x-admin-key, or Authorization: Bearer KEY); off without it",
    )
    api_key: str | None = Field(
        None,
        description="API keys clients must send as 'Authorization: Bearer KEY' on /v1/* (comma-separated); "
        "off without it and --api-key-file",
    )
    api_key_file: str | None = Field(
        None, description="file of API keys, one per line ('#' starts a comment)"
    )
    ssl_certfile: str | None = Field(None, description="serve HTTPS with this certificate (PEM)")
    ssl_keyfile: str | None = Field(None, description="the certificate's private key (PEM)")
    drain_delay_s: float = Field(
        0.0,
        ge=0,
        description="on SIGTERM, answer /health with 503 and keep serving this long before refusing new "
        "connections (for load balancers that only read /health)",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, how long answers under way may finish"
    )
    shared_secret: str | None = Field(None, description="side-channel secret, to read instances' KV geometry")
    block_size: int = Field(128, ge=1, description="tokens per KV block, as the instances' --block-size")
    tokenize_max_chars: int = Field(
        65536,
        ge=1,
        description="tokenize at most this many characters of a prompt (the prefix the index matches); longer "
        "prompts' lengths are estimated and their context-length check is left to the instances",
    )
    tokenize_probe_chars: int = Field(
        1024,
        ge=1,
        description="tokenize a long prompt's first this many characters first, and more (4x at a time, up to "
        "--tokenize-max-chars) only while an instance holds every block of it; a value at or over "
        "--tokenize-max-chars tokenizes the whole bounded prefix at once",
    )
    max_model_len: int | None = Field(None, description="context length to check; default: the instances'")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1, description="request bodies over this get 413")
    max_concurrency: int = Field(512, ge=1, description="requests in flight per worker; more wait in a queue")
    max_connections: int | None = Field(
        None,
        ge=1,
        description="client connections per worker at once; one more is answered 503 (default: half the "
        "open-file limit, which the proxy raises to its hard limit)",
    )
    max_queued: int = Field(
        1024,
        ge=0,
        description="requests that may wait for a slot per worker (by x-request-priority); more get 429",
    )
    queue_timeout_s: float = Field(
        30.0, gt=0, description="a request waiting longer than this for a slot gets 429"
    )
    workers: int = Field(
        1,
        ge=1,
        description="worker processes on one port (SO_REUSEPORT); they share in-flight counts and each follows "
        "every instance's KV events",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="longest wait for an instance's next byte (a non-streamed answer's first byte comes when its "
        "generation ends: past this it is answered 504, not retried), and for a client to take any of its answer",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="longest wait to connect to an instance")
    upstream_keepalive_s: float = Field(
        2.0,
        gt=0,
        description="idle connections to instances close after this (below their own keep-alive, 5 s)",
    )
    health_interval_s: float = Field(2.0, gt=0, description="seconds between health probes of each instance")
    loop_lag_interval_s: float = Field(
        0.01,
        ge=0,
        description="seconds between event-loop lag samples (vllm_disagg_event_loop_lag_seconds); 0: off",
    )
    breaker_failures: int = Field(3, ge=1, description="failures in a row that take an instance out")
    breaker_open_s: float = Field(10.0, gt=0, description="how long a failing instance stays out")
    transfer_deadline_s: float = Field(
        60.0,
        gt=0,
        description="a hand-off without decode's first token by then is aborted (the client gets 504)",
    )
    prefill_leg_grace_s: float = Field(
        5.0,
        gt=0,
        description="a prefill leg still unanswered this long after decode's first token is aborted on its "
        "instance: decode streams without it (it recomputed), so the prefill would only compute a prompt nobody "
        "reads; its answer, when it comes in time, reports prefill's cache hits and times the cost model",
    )
    # The cost model's targets and link speeds: one source of defaults for the proxy and the simulator.
    ttft_slo_s: float = Field(_COST_DEFAULTS.ttft_slo_s, gt=0, description="TTFT target of the cost policy")
    tpot_slo_s: float = Field(_COST_DEFAULTS.tpot_slo_s, gt=0, description="time-per-token target")
    prefix_pending_ttl_s: float = Field(
        10.0,
        ge=0,
        description="seconds a prompt just routed counts as cached on its instances before KV events say so, so "
        "prompts sharing a new prefix follow it (0: only what events report)",
    )
    split_ttft_gate: bool = Field(
        _COST_DEFAULTS.split_ttft_gate,
        description="enter the adaptive split only where it is predicted to miss the TTFT target less often than "
        "pooled serving is missing, and leave it past its prefill instance's capacity (docs/planner.md)",
    )
    length_weighted_stall: bool = Field(
        _COST_DEFAULTS.length_weighted_stall,
        description="price a prefill's stall by the output lengths (max_tokens) of the streams it hits, not only "
        "their number: a stream of 16 tokens takes a stall's TPOT eight times harder than one of 128",
    )
    split_min_offered_share: float = Field(
        _COST_DEFAULTS.min_offered_share,
        ge=0,
        le=1,
        description="with the gate, no split where under this share of the latest 60 arrivals were worth handing "
        "off, and a split left where under half of it are",
    )
    split_tpot_share: float = Field(
        _COST_DEFAULTS.split_tpot_share,
        gt=0,
        description="no adaptive split whose decode instances, carrying every stream, are predicted to settle "
        "slower than pooled streams and past this share of the TPOT target (or not to settle at all)",
    )
    split_settle_hold_s: float = Field(
        _COST_DEFAULTS.split_settle_hold_s,
        ge=0,
        description="nor until its decode instances have been predicted to settle through this many seconds of "
        "arrivals (the arrival rate swings with bursts; 0: no wait)",
    )
    kv_bytes_per_token: int = Field(
        0, ge=0, description="KV bytes per token over all layers; 0: from the instances' KV geometry"
    )
    link_bytes_per_s: float = Field(
        _COST_DEFAULTS.link_bytes_per_s, gt=0, description="KV transfer bandwidth between prefill and decode"
    )
    tier_bytes_per_s: float = Field(
        _COST_DEFAULTS.tier_bytes_per_s,
        gt=0,
        description="load bandwidth from the KV tier beneath each instance (LMCache CPU memory: ~10 GB/s over PCIe; "
        "a local disk: its read rate)",
    )
    recent_decisions: int = Field(200, ge=0, description="decisions kept for GET /admin/decisions")
    log_level: str = Field("info", description="debug | info | warning | error")
    otlp_traces_endpoint: str | None = Field(
        None,
        description="send OpenTelemetry spans of each request to this OTLP gRPC collector (pip install "
        "'vllm-disagg[tracing]'); traceparent goes on to the instances",
    )
    log_format: str = Field(
        "text",
        pattern="^(text|json)$",
        description="text, or json: one object per line, one line per request",
    )

    @field_validator("policy_args", mode="before")
    @classmethod
    def _policy_args(cls, v: Any) -> Any:
        """A config file may give the arguments as a mapping; a flag or the environment gives JSON text."""
        return json.dumps(v) if isinstance(v, dict) else v

    @classmethod
    def load(cls, path: str | None = None, **overrides: Any) -> ProxySettings:
        data: dict[str, Any] = {}
        if path:
            data = _read_structured(Path(path))
        for key in cls.model_fields:
            env = os.environ.get(ENV_PREFIX + key.upper())
            if env is not None and key != "instances":
                data[key] = env
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


def _read_structured(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        loaded = yaml.safe_load(text)
    else:
        loaded = json.loads(text)
    if isinstance(loaded, list):
        return {"instances": loaded}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping or a list of instances")
    return loaded


def read_instances_file(path: str) -> list[InstanceConfig]:
    """The instances a watched file lists: ``instances:`` (or the file itself) a list of mappings with
    InstanceConfig's fields or of the flags' ``URL;side=...;role=...`` strings. Anything else is an error (the
    caller keeps the instances it has), never an empty list: a typo must not remove every instance."""
    data = _read_structured(Path(path))
    unknown = sorted(set(data) - {"instances"})
    if unknown or "instances" not in data:
        raise ValueError(
            f"{path}: expected the key 'instances' (a list of instances), got "
            f"{', '.join(repr(k) for k in unknown) or 'none'}"
        )
    entries = data["instances"]
    if not isinstance(entries, list):
        raise ValueError(f"{path}: 'instances' must be a list, got {type(entries).__name__}")
    out = []
    for n, entry in enumerate(entries):
        try:
            out.append(
                InstanceConfig.parse(entry, None)
                if isinstance(entry, str)
                else InstanceConfig.model_validate(entry)
            )
        except ValidationError as exc:
            raise ValueError(f"{path}: instance {n + 1}: {one_line(exc)}") from None
        except ValueError as exc:
            raise ValueError(f"{path}: instance {n + 1}: {exc}") from None
    return out


def one_line(exc: ValidationError, whole: str = "value") -> str:
    """A pydantic error as one log line: each field (``whole`` for the object itself) and what is wrong with it."""
    return "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or whole}: {err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()
    )


def load_api_keys(settings: ProxySettings) -> tuple[bytes, ...]:
    """The API keys from ``api_key`` (comma-separated) and ``api_key_file`` (one per line, '#' comments)."""
    keys = [k.strip() for k in (settings.api_key or "").split(",")]
    if settings.api_key_file:
        for line in Path(settings.api_key_file).read_text().splitlines():
            keys.append(line.split("#", 1)[0].strip())
    return tuple(k.encode() for k in keys if k)
