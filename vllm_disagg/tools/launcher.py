"""`vllm-disagg launch CONFIG.yaml`: prefill, decode (and colocated) vLLM instances plus the proxy on one host.

One file describes the host: the model, each instance's role, port, core or GPU pinning, side-channel and KV-event
ports, the connector settings and the proxy's. The launcher starts everything, waits for health, prints where
everything listens, writes each process's log to a file, and stops every process group on Ctrl-C, SIGTERM or when
any process dies (no orphans: each vLLM dies with the launcher even if the launcher is SIGKILLed).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_disagg.config import ConnectorConfig
from vllm_disagg.tokenizer_files import tokenizer_dir
from vllm_disagg.tools.harness import (
    LMCacheServer,
    ProxyServer,
    VLLMServer,
    free_port,
    kv_events_args,
    start_many,
)


class InstanceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "both", "colocated"]
    name: str = ""
    port: int = 0  # 0: a free port
    cpu_cores: str | None = Field(
        None,
        description="cores for the CPU build, e.g. '0' or '0-3': the whole instance is pinned to them and "
        "VLLM_CPU_OMP_THREADS_BIND names them",
    )
    gpus: str | None = Field(None, description="CUDA_VISIBLE_DEVICES for the GPU build, e.g. '0'")
    side_channel_port: int = 0
    kv_events_port: int = 0
    kv_events_replay_port: int = 0
    args: list[str] = Field(default_factory=list, description="extra `vllm serve` flags for this instance")
    env: dict[str, str] = Field(default_factory=dict)


class ProxySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    port: int = 8000
    host: str = "127.0.0.1"
    policy: str = "cost"
    admin_key: str | None = None
    args: list[str] = Field(default_factory=list, description="extra `vllm-disagg proxy` flags")


class TierSpec(BaseModel):
    """An LMCache server beneath every instance (docs/lmcache.md): CPU memory, optionally a local disk below it.

    Prefill/decode instances then run DisaggTierConnector [DisaggConnector, LMCacheMPConnector], colocated ones
    LMCacheMPConnector alone, and the proxy prices tier hits at ``bytes_per_s``.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["lmcache"] = "lmcache"
    port: int = 0  # the server's ZMQ port (0: a free port)
    http_port: int = 0
    l1_size_gb: float = 1.0
    chunk_size: int = Field(256, description="a multiple of vLLM's block size")
    disk_path: str | None = Field(
        None, description="a local-disk tier beneath the memory one (LMCache 'fs' L2)"
    )
    bytes_per_s: float | None = Field(None, description="the proxy's --tier-bytes-per-s")
    args: list[str] = Field(default_factory=list, description="extra `lmcache server` flags")


class LaunchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    args: list[str] = Field(default_factory=list, description="`vllm serve` flags for every instance")
    kv_cache_gib: int = 1
    connector: dict[str, Any] = Field(default_factory=dict, description="kv_connector_extra_config for all")
    kv_events: bool = True
    log_dir: str = ".artifacts/launch"
    startup_timeout_s: float = 600.0
    instances: list[InstanceSpec]
    proxy: ProxySpec = Field(default_factory=ProxySpec)
    tier: TierSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> LaunchConfig:
        ConnectorConfig.from_extra_config(
            self.connector
        )  # same validation vLLM will apply, before starting anything
        roles = [i.role for i in self.instances]
        if not roles:
            raise ValueError("no instances")
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("prefill and decode instances come in pairs: configure at least one of each")
        return self

    @classmethod
    def load(cls, path: str) -> LaunchConfig:
        return cls.model_validate(yaml.safe_load(Path(path).read_text()))


def build_tier(cfg: LaunchConfig) -> LMCacheServer | None:
    """The LMCache server, if the config has a tier (pure: nothing is started)."""
    t = cfg.tier
    if t is None:
        return None
    l2 = ["--l2-adapter", json.dumps({"type": "fs", "base_path": t.disk_path})] if t.disk_path else []
    return LMCacheServer(
        "",
        host=cfg.host,
        port=t.http_port,
        zmq_port=t.port,
        l1_size_gb=t.l1_size_gb,
        chunk_size=t.chunk_size,
        l2=[*l2, *t.args],
        log_path=Path(cfg.log_dir) / "lmcache.log",
    )


def build_servers(cfg: LaunchConfig, tier: LMCacheServer | None = None) -> tuple[list[VLLMServer], list[str]]:
    """The vLLM processes to start, and the proxy's instance specs for them (pure: nothing is started)."""
    servers: list[VLLMServer] = []
    specs: list[str] = []
    log_dir = Path(cfg.log_dir)
    counts: dict[str, int] = {}
    for inst in cfg.instances:
        counts[inst.role] = counts.get(inst.role, 0) + 1
        name = inst.name or f"{inst.role}{counts[inst.role] - 1}"
        port = inst.port or free_port(cfg.host)
        args = [*cfg.args, *inst.args]
        env = dict(inst.env)
        if inst.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = inst.gpus
        spec = f"http://{cfg.host}:{port};id={name}"
        if inst.role != "colocated":
            side = inst.side_channel_port or free_port(cfg.host)
            extra = {"side_channel_port": side, **cfg.connector}
            extra.setdefault("side_channel_host", cfg.host)
            ktc: dict[str, Any] = {
                "kv_connector": "DisaggConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
            if (
                tier is not None
            ):  # DisaggConnector first: P/D loads win, plain requests fall through to the tier
                ktc = {
                    "kv_connector": "DisaggTierConnector",
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"connectors": [ktc, tier.mp_config()]},
                }
            args += ["--kv-transfer-config", json.dumps(ktc)]
            spec += f";side={cfg.host}:{side}"
        elif tier is not None:
            args += ["--kv-transfer-config", json.dumps(tier.mp_config())]
        if cfg.kv_events:
            ev = inst.kv_events_port or free_port(cfg.host)
            rp = inst.kv_events_replay_port or free_port(cfg.host)
            args += kv_events_args(ev, rp)
            spec += f";events=tcp://{cfg.host}:{ev};replay=tcp://{cfg.host}:{rp}"
        servers.append(
            VLLMServer(
                cfg.model,
                args=args,
                env=env,
                host=cfg.host,
                port=port,
                cpu_cores=inst.cpu_cores,
                kv_cache_gib=cfg.kv_cache_gib,
                log_path=log_dir / f"{name}.log",
                name=name,
            )
        )
        specs.append(spec)
    return servers, specs


def proxy_args(cfg: LaunchConfig, specs: list[str]) -> list[str]:
    args: list[str] = []
    for inst, spec in zip(cfg.instances, specs, strict=True):
        flag = {"prefill": "--prefill", "decode": "--decode"}.get(inst.role, "--both")
        args += [flag, spec]
    args += ["--policy", cfg.proxy.policy]
    tokenizer = tokenizer_dir(cfg.tokenizer or cfg.model)
    if tokenizer is not None:
        args += ["--tokenizer", tokenizer]
    else:  # a model id not in the local cache yet: the proxy tokenizes on the instances
        print(
            f"[launch] no local tokenizer for {cfg.tokenizer or cfg.model} (set tokenizer: to its directory): the "
            "proxy asks the instances' /tokenize",
            flush=True,
        )
    secret = cfg.connector.get("shared_secret")
    if secret:
        args += ["--shared-secret", str(secret)]
    if cfg.proxy.admin_key:
        args += ["--admin-key", cfg.proxy.admin_key]
    if cfg.tier is not None and cfg.tier.bytes_per_s:
        args += ["--tier-bytes-per-s", str(cfg.tier.bytes_per_s)]
    return [*args, *cfg.proxy.args]


def launch(cfg: LaunchConfig, wait: bool = True) -> int:
    Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    tier = build_tier(cfg)
    servers, specs = build_servers(cfg, tier)
    proxy: ProxyServer | None = None
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    try:
        if tier is not None:
            print(f"[launch] starting the LMCache tier; log {tier.log_path}", flush=True)
            tier.start().wait_healthy(180)
        print(f"[launch] starting {len(servers)} vLLM instance(s); logs in {cfg.log_dir}/", flush=True)
        start_many(servers, timeout=cfg.startup_timeout_s)
        if cfg.proxy.enabled:
            proxy = ProxyServer(
                "unused",
                args=proxy_args(cfg, specs),
                host=cfg.proxy.host,
                port=cfg.proxy.port,
                log_path=Path(cfg.log_dir) / "proxy.log",
            )
            proxy.start().wait_healthy(120)
        print(f"[launch] ready in {time.monotonic() - t0:.0f} s", flush=True)
        for inst, server in zip(cfg.instances, servers, strict=True):
            pin = f"cores {inst.cpu_cores}" if inst.cpu_cores else (f"GPUs {inst.gpus}" if inst.gpus else "")
            print(f"  {server.name:<12} {inst.role:<9} {server.url}  {pin}  log {server.log_path}")
        if proxy is not None:
            print(
                f"  {'proxy':<12} {'':<9} {proxy.url}  (OpenAI API; /metrics, /health)  log {proxy.log_path}"
            )
        print("[launch] Ctrl-C stops everything.", flush=True)
        if tier is not None:
            print(
                f"  {'lmcache':<12} {'tier':<9} {tier.url}  (zmq port {tier.zmq_port})  log {tier.log_path}"
            )
        while wait and not stop:
            others = [*([proxy] if proxy else []), *([tier] if tier else [])]
            dead = [s.name for s in [*servers, *others] if not s.alive()]
            if dead:
                print(
                    f"[launch] {', '.join(dead)} exited; stopping everything (see the logs)", file=sys.stderr
                )
                return 1
            time.sleep(0.5)
        return 0
    finally:
        print("[launch] stopping ...", flush=True)
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop()
        if tier is not None:
            tier.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        print("[launch] all processes stopped.", flush=True)
