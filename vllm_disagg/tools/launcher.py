"""`vllm-disagg launch CONFIG.yaml`: prefill, decode (and colocated) vLLM instances plus the proxy on one host.

One file describes the host: the model, each instance's role, port, core or GPU pinning, side-channel and KV-event
ports, the connector settings and the proxy's. Relative paths in it (model, tokenizer, tier disk) are read from the
file's folder, else the working directory. What can be checked before anything starts is (ports free and distinct,
cores present, the model and tokenizer found), each mistake as one line naming the field. The launcher then starts
everything, waits for health, prints where everything listens, writes each process's log to a file, and stops every
process group on Ctrl-C or SIGTERM (while starting too) or when any process dies. Nothing outlives it: a killed
launcher's instances, EngineCores and workers included, are stopped by the harness's reaper. Secrets reach the
processes through their environment, not their command lines (which every local user can read).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_disagg.config import ConnectorConfig
from vllm_disagg.tokenizer_files import tokenizer_dir
from vllm_disagg.tools.harness import (
    LMCacheServer,
    ProxyServer,
    ServerStartError,
    VLLMServer,
    cpu_list,
    free_port,
    kv_events_args,
    start_many,
)


def schema_text() -> str:
    """Every key a launch file takes, with its default and meaning (``vllm-disagg launch --schema``)."""
    lines: list[str] = []

    def section(title: str, model: type[BaseModel]) -> None:
        lines.append(title)
        for name, field in model.model_fields.items():
            if field.is_required():
                default = "required"
            elif field.default_factory is not None:
                default = "see below" if name in ("proxy",) else "empty"
            else:
                default = f"default {field.default!r}"
            lines.append(f"  {name:<22} {default:<24} {field.description or ''}".rstrip())

    section("top level:", LaunchConfig)
    section("instances[]:", InstanceSpec)
    section("proxy:", ProxySpec)
    section("tier:", TierSpec)
    return "\n".join(lines)


class LaunchError(ValueError):
    """A launch file that cannot work, said in one line naming the field and what to do."""


class InstanceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["prefill", "decode", "both", "colocated"] = Field(
        description="prefill | decode (a P/D pair, at least one of each) | both (either, for the adaptive policy) | "
        "colocated (no KV connector)"
    )
    name: str = Field("", description="its id at the proxy and its log's name (default: role and a number)")
    port: int = Field(0, ge=0, le=65535, description="its OpenAI API port (0: a free one)")
    cpu_cores: str | None = Field(
        None,
        description="cores for the CPU build, e.g. '0' or '0-3': the whole instance is pinned to them and "
        "VLLM_CPU_OMP_THREADS_BIND names them",
    )
    gpus: str | None = Field(None, description="CUDA_VISIBLE_DEVICES for the GPU build, e.g. '0'")
    side_channel_port: int = Field(
        0, ge=0, le=65535, description="its KV connector's side channel (0: a free one)"
    )
    kv_events_port: int = Field(0, ge=0, le=65535, description="its KV-event publisher (0: a free one)")
    kv_events_replay_port: int = Field(0, ge=0, le=65535, description="its KV-event replay (0: a free one)")
    args: list[str] = Field(default_factory=list, description="extra `vllm serve` flags for this instance")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for this instance")

    @field_validator("cpu_cores", "gpus", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        """``cpu_cores: 0`` is what a YAML user types: a number is its text."""
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("env", mode="before")
    @classmethod
    def _env_text(cls, v: Any) -> Any:
        return {k: str(x) for k, x in v.items()} if isinstance(v, dict) else v

    @field_validator("cpu_cores")
    @classmethod
    def _cores(cls, v: str | None) -> str | None:
        if v is not None:
            cpu_list(v)  # a ValueError saying what a cpu-list is
        return v


class ProxySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="start the proxy (false: the instances alone)")
    port: int = Field(default=8000, ge=0, le=65535, description="its port (0: a free one)")
    host: str = Field(default="127.0.0.1", description="the address it listens on")
    policy: str = Field(
        default="cost", description="--policy: cost | least-loaded | ... | module:Class | file.py:Class"
    )
    admin_key: str | None = Field(
        default=None, description="key for the admin API (passed in the environment)"
    )
    args: list[str] = Field(default_factory=list, description="extra `vllm-disagg proxy` flags")

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        owned = {"--host", "--port", "--prefill", "--decode", "--both"}
        taken = sorted({a.split("=", 1)[0] for a in v} & owned)
        if taken:
            raise ValueError(
                f"{', '.join(taken)} are the launcher's to set: use proxy.host, proxy.port and instances"
            )
        return v


class TierSpec(BaseModel):
    """An LMCache server beneath every instance (docs/lmcache.md): CPU memory, optionally a local disk below it.

    Prefill/decode instances then run DisaggTierConnector [DisaggConnector, LMCacheMPConnector], colocated ones
    LMCacheMPConnector alone, and the proxy prices tier hits at ``bytes_per_s``.
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["lmcache"] = Field(
        "lmcache", description="the tier's kind (LMCache's multi-process server)"
    )
    port: int = Field(0, ge=0, le=65535, description="the server's ZMQ port (0: a free one)")
    http_port: int = Field(0, ge=0, le=65535, description="the server's HTTP port (0: a free one)")
    l1_size_gb: float = Field(1.0, description="CPU memory it holds KV in")
    chunk_size: int = Field(256, description="a multiple of vLLM's block size")
    disk_path: str | None = Field(
        None, description="a local-disk tier beneath the memory one (LMCache 'fs' L2)"
    )
    bytes_per_s: float | None = Field(None, description="the proxy's --tier-bytes-per-s")
    args: list[str] = Field(default_factory=list, description="extra `lmcache server` flags")


class LaunchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="a model directory or Hugging Face id, as `vllm serve` takes it")
    tokenizer: str | None = Field(None, description="a tokenizer directory or id, for vLLM and the proxy")
    host: str = Field("127.0.0.1", description="the address the instances listen on")
    args: list[str] = Field(default_factory=list, description="`vllm serve` flags for every instance")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE of each instance (CPU build)")
    connector: dict[str, Any] = Field(
        default_factory=dict, description="kv_connector_extra_config for all (docs: Face 1)"
    )
    kv_events: bool = Field(True, description="publish KV events to the proxy's prefix index")
    log_dir: str = Field(".artifacts/launch", description="where each process's log goes")
    startup_timeout_s: float = Field(600.0, gt=0, description="how long instances may take to become healthy")
    instances: list[InstanceSpec] = Field(description="one entry per vLLM instance")
    proxy: ProxySpec = Field(default_factory=ProxySpec, description="the proxy in front of them")
    tier: TierSpec | None = Field(
        None, description="an LMCache tier beneath every instance (docs/lmcache.md)"
    )

    @model_validator(mode="after")
    def _check(self) -> LaunchConfig:
        ConnectorConfig.from_extra_config(
            self.connector
        )  # same validation vLLM will apply, before starting anything
        for key in ("side_channel_port", "side_channel_host"):
            if key in self.connector:
                raise ValueError(
                    f"connector.{key} would be the same for every instance (the second could not bind it, and the "
                    f"proxy would be told another): set instances[i].side_channel_port, and host: for the address"
                )
        roles = [i.role for i in self.instances]
        if not roles:
            raise ValueError("no instances")
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("prefill and decode instances come in pairs: configure at least one of each")
        names = [i.name for i in self.instances if i.name]
        if len(set(names)) != len(names):
            raise ValueError(
                f"instance names must differ (each names a log file and a proxy instance): {names}"
            )
        seen: dict[int, str] = {}
        for field, port in self.fixed_ports():
            if port in seen:
                raise ValueError(f"{field} and {seen[port]} are both port {port}")
            seen[port] = field
        return self

    def fixed_ports(self) -> list[tuple[str, int]]:
        """(field, port) of every port the file fixes (0: one is picked when starting)."""
        ports = [("proxy.port", self.proxy.port)] if self.proxy.enabled else []
        for i, inst in enumerate(self.instances):
            for name in ("port", "side_channel_port", "kv_events_port", "kv_events_replay_port"):
                ports.append((f"instances[{i}].{name}", getattr(inst, name)))
        if self.tier is not None:
            ports += [("tier.port", self.tier.port), ("tier.http_port", self.tier.http_port)]
        return [(f, p) for f, p in ports if p]

    @classmethod
    def load(cls, path: str) -> LaunchConfig:
        """The file at ``path``; a relative model, tokenizer or tier disk path is taken from the file's folder when
        it exists there, else from the working directory. LaunchError (one line) for anything wrong."""
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise LaunchError(f"{path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise LaunchError(f"{path}: not YAML: {str(exc).splitlines()[0]}") from None
        if not isinstance(raw, dict):
            raise LaunchError(
                f"{path}: expected a mapping of settings (model:, instances:, ...), not {raw!r}"
            )
        here = Path(path).resolve().parent
        for key, holder in (("model", raw), ("tokenizer", raw), ("disk_path", raw.get("tier"))):
            if isinstance(holder, dict) and isinstance(holder.get(key), str):
                holder[key] = _from_file(holder[key], here)
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise LaunchError(f"{path}: {_one_line(exc)}") from None


def _from_file(value: str, here: Path) -> str:
    """``value`` resolved against the launch file's folder where that names something, else as given."""
    p = Path(value).expanduser()
    if p.is_absolute() or not (here / p).exists():
        return str(p) if value.startswith("~") else value
    return str(here / p)


def _one_line(exc: ValidationError) -> str:
    """A pydantic error as the launch file's fields: 'instances[0]: unknown key 'cpu_core' (did you mean ...)'."""
    parts = []
    for err in exc.errors():
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"]).lstrip(".")
        if err["type"] == "extra_forbidden":
            field = str(err["loc"][-1])
            where, _, _ = loc.rpartition(".")
            known = _known_keys(err["loc"][:-1])
            close = difflib.get_close_matches(field, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
            parts.append(f"{where or 'top level'}: unknown key {field!r}{hint}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = LaunchConfig
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = model.model_fields[str(part)].annotation
        inner = [a for a in (*getattr(annotation, "__args__", ()), annotation) if isinstance(a, type)]
        nested = [a for a in inner if issubclass(a, BaseModel)]
        if not nested:
            return []
        model = nested[0]
    return list(model.model_fields)


def preflight(cfg: LaunchConfig) -> None:
    """What can be checked on this host before anything starts (LaunchError, one line): the fixed ports free, the
    cores present, the model and tokenizer found."""
    for field, port in cfg.fixed_ports():
        _check_free(field, cfg.proxy.host if field == "proxy.port" else cfg.host, port)
    here = os.sched_getaffinity(0)
    for i, inst in enumerate(cfg.instances):
        if inst.cpu_cores is not None:
            missing = cpu_list(inst.cpu_cores) - here
            if missing:
                raise LaunchError(
                    f"instances[{i}].cpu_cores: core(s) {sorted(missing)} are not available here (this process may "
                    f"run on {_ranges(here)})"
                )
    if _path_like(cfg.model) and not Path(cfg.model).expanduser().exists():
        raise LaunchError(
            f"model: {cfg.model} does not exist (relative paths are read from the launch file's folder, else the "
            "working directory); `vllm-disagg tiny-model .artifacts/tiny-model` writes the tiny one"
        )
    if cfg.tier is not None and importlib.util.find_spec("lmcache") is None:
        raise LaunchError(
            "tier: lmcache is not installed in this Python; run scripts/setup-lmcache.sh and launch with "
            ".venv-lmcache/bin/vllm-disagg"
        )
    if (
        cfg.tokenizer is not None
        and _path_like(cfg.tokenizer)
        and not Path(cfg.tokenizer).expanduser().exists()
    ):
        raise LaunchError(
            f"tokenizer: {cfg.tokenizer} does not exist; give the tokenizer's directory or a Hugging Face id, or "
            "leave tokenizer: out (vLLM reads the model's own)"
        )


def _path_like(name: str) -> bool:
    """A local path rather than a Hugging Face id ("org/name", fetched by vLLM) or a URL (s3://, gs://)."""
    return "://" not in name and (name.startswith((".", "/", "~")) or name.count("/") > 1)


def _check_free(field: str, host: str, port: int) -> None:
    """LaunchError unless ``port`` can be listened on at ``host``. With SO_REUSEADDR, as the servers bind: a port
    still in TIME_WAIT from the last run is free to them."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise LaunchError(f"{field}: host {host!r} does not resolve here ({exc.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise LaunchError(
                f"{field}: port {port} on {host} is taken ({exc.strerror}); stop what holds it "
                f"(`ss -ltnp | grep :{port}`) or choose another"
            ) from None


def _ranges(cores: set[int]) -> str:
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cores):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


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
        if cfg.tokenizer is not None and "--tokenizer" not in args:
            args += ["--tokenizer", cfg.tokenizer]
        env = dict(inst.env)
        connector = dict(cfg.connector)
        secret = connector.pop("shared_secret", None)
        if secret:
            env.setdefault(
                "VLLM_DISAGG_SECRET", str(secret)
            )  # not on the command line: `ps` shows that to all
        if inst.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = inst.gpus
        spec = f"http://{cfg.host}:{port};id={name}"
        if inst.role != "colocated":
            side = inst.side_channel_port or free_port(cfg.host)
            extra = {"side_channel_port": side, **connector}
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
                offline=False,  # a model id is fetched on first start, as `vllm serve` does
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
    if cfg.tier is not None and cfg.tier.bytes_per_s:
        args += ["--tier-bytes-per-s", str(cfg.tier.bytes_per_s)]
    return [*args, *cfg.proxy.args]


def proxy_env(cfg: LaunchConfig) -> dict[str, str]:
    """The proxy's secrets, as its environment settings (VLLM_DISAGG_PROXY_*): kept off its command line."""
    env = {}
    secret = cfg.connector.get("shared_secret")
    if secret:
        env["VLLM_DISAGG_PROXY_SHARED_SECRET"] = str(secret)
    if cfg.proxy.admin_key:
        env["VLLM_DISAGG_PROXY_ADMIN_KEY"] = cfg.proxy.admin_key
    return env


class _Interrupted(BaseException):
    """Ctrl-C or SIGTERM while starting: unwinds the start-up (everything started so far is stopped)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def launch(cfg: LaunchConfig, wait: bool = True) -> int:
    preflight(cfg)
    try:
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LaunchError(
            f"log_dir: cannot create {cfg.log_dir} ({exc.strerror}); choose a folder you can write"
        ) from None
    tier = build_tier(cfg)
    servers, specs = build_servers(cfg, tier)
    for server in [*servers, *([tier] if tier else [])]:
        assert server.log_path is not None
        with open(server.log_path, "a") as log:  # the log is appended to: mark where this run begins
            log.write(
                f"\n===== vllm-disagg launch {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} =====\n"
            )
    proxy: ProxyServer | None = None
    stop = 0
    starting = True

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop, starting
        stop = signum
        if starting:  # once: a second Ctrl-C must not cut the cleanup the first one started
            starting = False
            raise _Interrupted(signum)

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
                env=proxy_env(cfg),
                host=cfg.proxy.host,
                port=cfg.proxy.port,
                log_path=Path(cfg.log_dir) / "proxy.log",
            )
            proxy.start().wait_healthy(120)
        starting = False
        print(f"[launch] ready in {time.monotonic() - t0:.0f} s", flush=True)
        for inst, server in zip(cfg.instances, servers, strict=True):
            pin = f"cores {inst.cpu_cores}" if inst.cpu_cores else (f"GPUs {inst.gpus}" if inst.gpus else "")
            print(f"  {server.name:<12} {inst.role:<9} {server.url}  {pin}  log {server.log_path}")
        if proxy is not None:
            print(
                f"  {'proxy':<12} {'':<9} {proxy.url}  (OpenAI API; /metrics, /health)  log {proxy.log_path}"
            )
        if tier is not None:
            print(
                f"  {'lmcache':<12} {'tier':<9} {tier.url}  (zmq port {tier.zmq_port})  log {tier.log_path}"
            )
        if proxy is not None:
            print(
                f"  try: curl {proxy.url}/v1/completions -H 'content-type: application/json' "
                f"-d '{json.dumps({'model': cfg.model, 'prompt': 'Hello', 'max_tokens': 16})}'"
            )
        print("[launch] Ctrl-C stops everything.", flush=True)
        while wait and not stop:
            others = [*([proxy] if proxy else []), *([tier] if tier else [])]
            for s in [*servers, *others]:
                if not s.alive():
                    code = s.proc.poll() if s.proc is not None else None
                    print(
                        f"[launch] {s.name} exited (code {code}); stopping everything. Its log: {s.log_path}",
                        file=sys.stderr,
                    )
                    return 1
            time.sleep(0.5)
        return 128 + stop if stop else 0
    except _Interrupted as interrupted:
        print(f"[launch] {signal.Signals(interrupted.signum).name} while starting", flush=True)
        return 128 + interrupted.signum
    except ServerStartError as failed:
        raise LaunchError(str(failed)) from None
    finally:
        starting = False  # a Ctrl-C while stopping is noted, never raised into the cleanup
        print("[launch] stopping ...", flush=True)
        if proxy is not None:
            # room for its own drain: --drain-delay-s and --shutdown-grace-s (30 s) for open streams
            proxy.stop(grace=40.0)
        for s in servers:
            s.stop()
        if tier is not None:
            tier.stop()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        print("[launch] all processes stopped.", flush=True)
