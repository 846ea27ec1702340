"""Router overhead, side by side: direct to the backends, through vllm-disagg's proxy, through the Rust vllm-router.

    python benchmarks/proxy.py                       # every cell, 2,000 requests each (issue #15's measurement)
    python benchmarks/proxy.py --quick               # a smoke run (< 30 s): few requests per cell
    python benchmarks/proxy.py --cells c16 --profile .artifacts/proxy-c16.txt   # + a py-spy profile of the proxy

Set-up, in one run:

* two fast mock OpenAI backends (``benchmarks/fast_backend.py``: asyncio + uvloop + httptools), one of them with a
  ZMQ side channel that answers the proxy's ``Describe``, so the P/D cell makes real transfer plans;
* the router under test ALONE on core 0 (``taskset -c 0``), started in its turn: ``vllm-disagg proxy`` with the
  default policy, ``--tokenizer .artifacts/tiny-model`` and ``--log-level warning``; then ``vllm-router`` (PyPI,
  installed into ``.artifacts/vllm-router-venv`` when absent) with ``--policy round_robin``;
* everything else (this script and its load generator, the backends) on core 1;
* a closed-loop load generator (``benchmarks/loadgen.py``: httptools, keep-alive, prebuilt request bytes).

Cells (``--cells``):

* ``c1``, ``c16``, ``c64``: streamed /v1/completions, a short prompt, ``max_tokens`` 16, at that concurrency, over
  two ``--both`` backends (vllm-router: ``--worker-urls A B``);
* ``pd``: streamed requests at concurrency 16 with ~2,000-character prompts, every one a KV transfer plan:
  ``--prefill A;side=127.0.0.1:PORT --decode B --policy always-transfer`` (vllm-router: ``--vllm-pd-disaggregation
  --prefill A --decode B``). The default cost policy would recompute many of them on the decode instance (against
  backends that answer at once its queue estimates call the prefill instance busy), and a mix cannot say what one
  transfer costs; the share of transfer plans is still read from the ``x-disagg-path`` header;
* ``pdc``: the same prompts over the two ``--both`` backends with the default policy (local plans only): the P/D
  cell's reference. The CPU of one transfer plan is (pd - (1 - share) x pdc) / share, which is pd when every plan
  transferred (always-transfer skips the cost model's ~40 µs, so the ratio flatters transfers by ~3%);
* ``big``: ~200 KB prompts (each distinct), streamed at concurrency 2; then the same again while a probe GETs the
  router's ``/health`` every 1 ms on its own connection: the largest probe latency is the router's worst
  event-loop stall (the probed pass is not counted in CPU, req/s or TTFT). For vllm-disagg the measured pass also
  reads the proxy's own loop-lag histogram, beside ``benchmarks/lag_canary.py``: the same monitor in a process with
  no work on the router's core, at real-time priority, whose lag is the host's floor;
* ``long``: 1,000-token streams whose chunks the backend spaces 1 ms apart, at concurrency 8: router CPU per
  request / 1,000 is its cost of relaying one chunk.

Per cell and target: req/s (requests / wall time of the cell), TTFT p50/p99 (first response-body byte), added TTFT
= the target's percentile minus the direct path's same percentile in the same cell (not paired: closed-loop
requests are not matched one to one), and router CPU per request: utime+stime from ``/proc/<pid>/stat`` summed over
the router's process tree, read before and after the cell, divided by the cell's requests (``cpu_us_per_req``;
clock-tick resolution, 10 ms). ``sched_us_per_req`` is the same from ``/proc/<pid>/task/*/schedstat`` (ns resolution,
live threads only) as a cross-check. Warm-up requests run before each target's first cell and are not counted.

The run ends with issue #15's targets checked against what it measured (PASS/FAIL lines, also in the JSON), and
with ``--profile FILE``, a py-spy profile of the proxy during a repeat of the c16 cell (not counted in the table):
the top functions by self and inclusive time. ``--router-policy`` sets vllm-router's policy (default round_robin,
the cheapest; its own default is cache_aware). ``--targets direct,vllm-disagg,vllm-disagg:least-loaded`` adds the
proxy under another policy beside the default (the ``--both`` cells), which shows what the policy itself costs per
request. The script pins itself to core 1; it needs ``taskset``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402
from report import (  # noqa: E402
    cpu_description,
    cpu_stat_fields,
    cpu_ticks,
    machine_info,
    metric_samples,
    percentile,
    render_table,
    steal_share,
)

from vllm_disagg.router.config import ProxySettings  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / ".artifacts" / "tiny-model"
ROUTER_VENV = ROOT / ".artifacts" / "vllm-router-venv"
MODEL = "mock"
ROUTER_CORE = 0
CLIENT_CORE = 1
# the proxy's default --loop-lag-interval-s, which the lag canary uses too
LAG_INTERVAL_S = ProxySettings.model_fields["loop_lag_interval_s"].default
CLK_TCK = os.sysconf("SC_CLK_TCK")

PD_PROMPT_CHARS = 2_000  # ~960 tokens of the tiny model's tokenizer: the default cost policy transfers them
SHORT_PROMPT = "Hello, how are you today? Tell me a story about a router."
_WORDS = re.findall(
    r"\w+",
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu kv cache prefill decode transfer token",
)


@dataclass
class Cell:
    name: str
    topology: str  # "colo" (two --both backends) or "pd" (prefill A -> decode B)
    concurrency: int
    requests: int
    max_tokens: int
    prompt_chars: int  # 0: the short prompt
    probe: bool = False  # the /health loop-lag probe runs during the cell


@dataclass
class Target:
    name: str
    url: str
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- /proc


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def cpu_seconds(pid: int) -> tuple[float, float, float]:
    """(utime+stime from /proc/<pid>/stat, on-CPU time from the threads' schedstat, stime alone), summed over the
    tree. stime is the kernel's share: on loopback, mostly the sockets' send and receive paths."""
    ticks = 0
    sys_ticks = 0
    sched_ns = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
            sys_ticks += int(fields[12])
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    sched_ns += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return ticks / CLK_TCK, sched_ns / 1e9, sys_ticks / CLK_TCK


def core_busy_seconds(core: int) -> tuple[float, float]:
    """(busy, stolen) seconds of one core since boot (/proc/stat). Busy is what ran there (with the router's own CPU
    subtracted, what else did); stolen is the time the hypervisor ran another guest on it, which no process here
    used but which delays the router all the same."""
    v = cpu_stat_fields(f"cpu{core}")  # user nice system idle iowait irq softirq steal; guest time is in user
    if not v:
        return 0.0, 0.0
    return (sum(v[:7]) - v[3] - v[4]) / CLK_TCK, v[7] / CLK_TCK


# ---------------------------------------------------------------------------------------------------- processes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""


def wait_ready(
    url: str, proc: subprocess.Popen[bytes] | None, timeout: float, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"{url}: process exited with {proc.returncode}\n{tail}")
        if _get(url)[0] == 200:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready within {timeout:g} s")


def wait_workers(url: str, workers: int, timeout: float = 60.0) -> None:
    """Until every worker of a ``--workers`` proxy has answered a completion: /health is answered by whichever
    worker listens first, and a worker still starting (imports, tokenizer) would charge its start-up to the first
    cell. Each request goes on a new connection, which the kernel hands to one of the workers."""
    seen: set[str] = set()
    body = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{url}: only workers {sorted(seen)} of {workers} answered within {timeout:g} s"
            )
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()
                path = r.headers.get("x-disagg-path", "")
        except OSError:
            time.sleep(0.1)
            continue
        if "worker=" in path:
            seen.add(path.rsplit("worker=", 1)[1].split(";")[0].strip())


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def start_backend(port: int, side: int | None, logdir: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "fast_backend.py"),
        "--port",
        str(port),
        "--model",
        MODEL,
    ]
    if side:
        cmd += ["--side", str(side)]
    log = logdir / f"backend-{port}.log"
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}/health", proc, 20, log)
    return proc


def _pinned(cmd: list[str]) -> list[str]:
    return ["taskset", "-c", str(ROUTER_CORE), *cmd]


def start_proxy(
    topology: str, a: str, b: str, side: int, logdir: Path, workers: int = 1, policy: str | None = None
) -> Target:
    port = free_port()
    if topology == "colo":
        inst = ["--both", a, "--both", b] + (["--policy", policy] if policy else [])
    else:
        # every request a transfer plan: the cell measures what one costs (see the module docstring)
        inst = ["--prefill", f"{a};side=127.0.0.1:{side}", "--decode", b, "--policy", "always-transfer"]
    cmd = [
        sys.executable,
        "-m",
        "vllm_disagg.cli",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *inst,
    ]
    cmd += ["--tokenizer", str(TOKENIZER), "--log-level", "warning"]
    if workers > 1:
        cmd += ["--workers", str(workers)]
    name = "vllm-disagg" if workers == 1 else f"vllm-disagg-w{workers}"
    if policy:
        name += f":{policy}"
    log = logdir / f"{name.replace(':', '-')}-{topology}.log"
    proc = subprocess.Popen(_pinned(cmd), stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", proc, 90, log)
    if workers > 1:
        wait_workers(url, workers)
    return Target(name, url, proc, log, {"cmd": " ".join(cmd), "request_path": request_path(url)})


def request_path(url: str) -> str:
    """How the proxy runs its request path, from its /metrics: "compiled" (mypyc) or "source"."""
    status, body = _get(url + "/metrics")
    found = (
        re.search(rb'vllm_disagg_proxy_build_info\{request_path="(\w+)"\} 1', body) if status == 200 else None
    )
    return found.group(1).decode() if found else "unknown"


def worker_shares(url: str) -> dict[str, float]:
    """Requests each worker of a ``--workers`` proxy took, from its /metrics (any worker shows all of them, each
    worker's counts as of its last once-a-second flush: read after one)."""
    time.sleep(1.2)
    status, raw = _get(url + "/metrics")
    samples = metric_samples(raw.decode(), "vllm_disagg_worker_requests_total") if status == 200 else []
    return {labels["worker"]: value for labels, value in samples}


def loop_lag_buckets(url: str) -> dict[float, float]:
    """The proxy's event-loop lag histogram from its /metrics: cumulative count per upper bound (s); {} if absent."""
    status, raw = _get(url + "/metrics")
    samples = (
        metric_samples(raw.decode(), "vllm_disagg_event_loop_lag_seconds_bucket") if status == 200 else []
    )
    return {float(labels["le"]): value for labels, value in samples}


@dataclass
class LagCanary:
    proc: subprocess.Popen[bytes]
    realtime: bool  # SCHED_FIFO was granted: the router cannot delay it


def start_lag_canary() -> LagCanary | None:
    """``benchmarks/lag_canary.py`` on the router's core, measuring once this returns: the lag a loop with no work
    records there, at real-time priority, is the host's, not the router's. None (with a warning) where it does not
    start: the router's own lag is read all the same."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "lag_canary.py"), str(LAG_INTERVAL_S)]
    proc = subprocess.Popen(_pinned(cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    ready = proc.stdout.readline().split()  # "ready ..." once it measures, or EOF when it died
    if ready[:1] == [b"ready"]:
        return LagCanary(proc, ready[1:] == [b"realtime"])
    _reap(proc)
    print(f"[proxy-bench] benchmarks/lag_canary.py did not start ({ready!r}): no host floor", file=sys.stderr)
    return None


def _reap(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        proc.communicate(timeout=10)  # closes its pipes


def stop_lag_canary(canary: LagCanary) -> dict[str, Any]:
    """The canary's lag counts (``canary_lag_*``, shaped like the proxy's ``loop_lag_*``); ``canary_error`` where
    it gave none."""
    try:
        raw, _ = canary.proc.communicate(timeout=10)  # closing its stdin ends it
        counts: dict[str, float] = dict(json.loads(raw)["counts"])
    except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError) as exc:
        _reap(canary.proc)
        return {"canary_error": f"benchmarks/lag_canary.py gave no counts: {exc!r}"}
    per_bucket = [(float(b) / 1000, n) for b, n in counts.items()]
    return {**lag_summary("canary_lag", per_bucket), "canary_realtime": canary.realtime}


def lag_bucket_counts(before: dict[float, float], after: dict[float, float]) -> list[tuple[float, float]]:
    """(upper bound in s, samples in that bucket alone) gained between two ``loop_lag_buckets`` readings."""
    bounds = sorted(after)
    gained = [after[b] - before.get(b, 0.0) for b in bounds]  # cumulative
    return [
        (b, g - (gained[i - 1] if i else 0.0)) for i, (b, g) in enumerate(zip(bounds, gained, strict=True))
    ]


def worst_bucket(counts: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """(lower, upper bound in s, all samples) of the highest bucket with samples in per-bucket ``counts``."""
    total = sum(n for _, n in counts)
    if total <= 0:
        return None
    top = max(i for i, (_, n) in enumerate(counts) if n > 0)
    return (counts[top - 1][0] if top else 0.0), counts[top][0], total


def worst_lag_bucket(
    before: dict[float, float], after: dict[float, float]
) -> tuple[float, float, float] | None:
    """(lower, upper bound in s, samples) of the highest lag bucket that gained samples between two readings."""
    return worst_bucket(lag_bucket_counts(before, after))


def lag_summary(prefix: str, counts: list[tuple[float, float]]) -> dict[str, Any]:
    """One lag histogram's per-bucket ``counts`` (upper bound in s) as result keys: ``{prefix}_counts`` (by upper
    bound in ms), the worst bucket's bounds (``_max_gt_ms``, ``_max_le_ms``), ``_samples`` and ``_over_2ms``."""
    out: dict[str, Any] = {
        f"{prefix}_counts": {f"{1000 * b:g}": n for b, n in counts},
        f"{prefix}_over_2ms": sum(n for b, n in counts if b > 0.002),
    }
    worst = worst_bucket(counts)
    if worst is not None:
        out[f"{prefix}_max_gt_ms"], out[f"{prefix}_max_le_ms"] = 1000 * worst[0], 1000 * worst[1]
        out[f"{prefix}_samples"] = worst[2]
    return out


def ensure_vllm_router(path: str | None) -> tuple[str, str] | None:
    """(binary, version) of vllm-router; installed into .artifacts/vllm-router-venv when absent."""
    binary = path or str(ROUTER_VENV / "bin" / "vllm-router")
    if not Path(binary).exists() and path is None:
        print(f"installing vllm-router into {ROUTER_VENV} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True)
        subprocess.run([str(ROUTER_VENV / "bin" / "pip"), "install", "-q", "vllm-router"], check=True)
    if not Path(binary).exists():
        return None
    # Ask the venv's interpreter, not its pip script: a venv that was copied keeps a stale shebang in its scripts.
    python = Path(binary).parent / "python"
    version = "?"
    if python.exists():
        with contextlib.suppress(OSError):
            out = subprocess.run(
                [str(python), "-m", "pip", "show", "vllm-router"], capture_output=True, text=True
            ).stdout
            version = next((ln.split()[-1] for ln in out.splitlines() if ln.startswith("Version:")), "?")
    return binary, version


def start_vllm_router(binary: str, topology: str, a: str, b: str, logdir: Path, policy: str) -> Target:
    port = free_port()
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--log-level", "warning", "--prometheus-port", str(free_port())]
    cmd += ["--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "60"]
    if topology == "colo":
        cmd += ["--worker-urls", a, b]
    else:
        cmd += ["--vllm-pd-disaggregation", "--prefill", a, "--decode", b]
    log = logdir / f"vllm-router-{topology}.log"
    proc = subprocess.Popen(_pinned(cmd), stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url + "/health", proc, 90, log)
    return Target("vllm-router", url, proc, log, {"cmd": " ".join(cmd)})


# ---------------------------------------------------------------------------------------------------- requests


def make_prompt(chars: int, seed: int) -> str:
    if chars <= 0:
        return SHORT_PROMPT
    rnd = random.Random(seed)
    words = [f"req{seed}"]  # a distinct first block: no prefix-cache hit between requests
    n = len(words[0])
    while n < chars:
        w = rnd.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)


def request_bytes(url: str, cell: Cell, count: int, seed: int = 0) -> list[bytes]:
    out = []
    for i in range(count):
        body = {
            "model": MODEL,
            "prompt": make_prompt(cell.prompt_chars, seed + i),
            "max_tokens": cell.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        out.append(loadgen.build_request(url, "/v1/completions", json.dumps(body).encode()))
    return out


def cell_seed(cell: Cell, run: int = 0) -> int:
    """The first prompt seed of a pass of a cell (0: measured, 1: its probe pass, 2 and 3: the profile's). Each pass
    has prompts of its own: a long prompt's first words come from its seed, and cells that shared seeds would find
    each other's prefixes in the proxy's index (the 200 KB cell's prompts began with the 2,000-character cells'),
    which measures the staged tokenization of a cached prefix instead of a new prompt."""
    return (zlib.crc32(cell.name.encode()) % 10_000) * 10**7 + run * 10**6


def distinct_prompts(cell: Cell) -> int:
    """Long prompts are distinct per request (no prefix-cache hits: the proxy's index would route a repeat to where
    it ran, and a cached prompt is not transferred); the short prompt is one for all."""
    return cell.requests if cell.prompt_chars > 0 else 1


# ---------------------------------------------------------------------------------------------------- one cell


def run_cell(
    cell: Cell, target: Target, urls: list[str], cpu_pid: int | None, run: int = 0
) -> dict[str, Any]:
    """Measure ``cell``; a probed cell runs twice: measured without the probe (its /health requests would count
    as router CPU), then again with it for the loop lag only (``probe_*`` keys). For vllm-disagg the measured pass
    also reads the proxy's own event-loop lag histogram before and after (``loop_lag_*``: the highest bucket that
    gained samples), outside the CPU window, and runs ``lag_canary.py`` beside it (``canary_lag_*``)."""
    measure_lag = cell.probe and target.name == "vllm-disagg" and cpu_pid is not None
    canary = start_lag_canary() if measure_lag else None
    canary_out: dict[str, Any] = {}
    try:
        lag_before = loop_lag_buckets(target.url) if measure_lag else {}
        out = _run_cell(replace(cell, probe=False), urls, cpu_pid, cell_seed(cell, 2 * run))
        if lag_before:
            # samples per bucket during the cell, not cumulative
            out.update(lag_summary("loop_lag", lag_bucket_counts(lag_before, loop_lag_buckets(target.url))))
    finally:
        # stopped after the proxy's reading: the canary's exit runs at its priority, ahead of the proxy
        if canary is not None:
            canary_out = stop_lag_canary(canary)
    out.update(canary_out)
    if cell.probe:
        # new prompts: no prefix hits from the first pass
        lag = _run_cell(cell, urls, None, cell_seed(cell, 2 * run + 1))
        out.update({k: v for k, v in lag.items() if k.startswith("probe_")})
    return out


def _run_cell(cell: Cell, urls: list[str], cpu_pid: int | None, seed: int = 0) -> dict[str, Any]:
    reqs = request_bytes(urls[0], cell, distinct_prompts(cell), seed)

    async def go() -> tuple[loadgen.RunStats, list[tuple[float, float]]]:
        import asyncio

        stop_ev = asyncio.Event()
        probe_task = None
        if cell.probe:
            probe_task = asyncio.create_task(loadgen.probe(urls[0], "/health", 0.001, stop_ev))
            await asyncio.sleep(0.2)  # a baseline before the load
        try:
            stats = await loadgen.closed_loop(
                urls, reqs, cell.concurrency, cell.requests, header="x-disagg-path"
            )
        finally:
            if probe_task is not None:
                await asyncio.sleep(0.1)
                stop_ev.set()
        samples = await probe_task if probe_task is not None else []
        return stats, samples

    before = cpu_seconds(cpu_pid) if cpu_pid else (0.0, 0.0, 0.0)
    (core0, stolen0), ticks = core_busy_seconds(ROUTER_CORE), cpu_ticks()
    stats, samples = loadgen.run(go)
    core0_after, stolen_after = core_busy_seconds(ROUTER_CORE)
    core0, stolen0 = core0_after - core0, stolen_after - stolen0
    steal = steal_share(ticks, cpu_ticks())
    after = cpu_seconds(cpu_pid) if cpu_pid else (0.0, 0.0, 0.0)
    ok = [r for r in stats.results if r.status == 200]
    ttft = [r.ttft for r in ok if not math.isnan(r.ttft)]
    total = [r.total for r in ok]
    n = len(stats.results) + len(stats.errors)
    out: dict[str, Any] = {
        "requests": n,
        "ok": len(ok),
        "errors": len(stats.errors) + len(stats.results) - len(ok),
        "wall_s": stats.wall_s,
        "rps": len(ok) / stats.wall_s if stats.wall_s else 0.0,
        "ttft_p50_ms": 1000 * percentile(ttft, 50) if ttft else float("nan"),
        "ttft_p99_ms": 1000 * percentile(ttft, 99) if ttft else float("nan"),
        "e2e_p50_ms": 1000 * percentile(total, 50) if total else float("nan"),
        "events_per_req": sum(r.events for r in ok) / len(ok) if ok else 0.0,
        "steal_pct": 100 * steal,  # the hypervisor's share of this VM's CPUs during the cell
    }
    if stats.errors or len(ok) < len(stats.results):
        bad = Counter(str(r.status) for r in stats.results if r.status != 200) + Counter(stats.errors)
        out["error_kinds"] = dict(bad.most_common(5))
    if cpu_pid:
        out["cpu_s"] = after[0] - before[0]
        out["kernel_pct"] = 100 * (after[2] - before[2]) / out["cpu_s"] if out["cpu_s"] else 0.0
        # other processes' CPU on the router's core during the cell, as a share of the cell's wall time (a quiet
        # machine: ~0; more means the router was not alone and its req/s and latencies are pessimistic)
        out["core0_others_s"] = max(0.0, core0 - out["cpu_s"])  # 10 ms ticks, like cpu_s
        out["core0_others_pct"] = 100 * out["core0_others_s"] / stats.wall_s if stats.wall_s else 0.0
        out["core0_steal_pct"] = 100 * stolen0 / stats.wall_s if stats.wall_s else 0.0
        out["cpu_us_per_req"] = 1e6 * out["cpu_s"] / n if n else 0.0
        out["sched_us_per_req"] = 1e6 * (after[1] - before[1]) / n if n else 0.0
        if cell.max_tokens >= 256:
            out["cpu_us_per_chunk"] = out["cpu_us_per_req"] / cell.max_tokens
    paths = Counter(r.header.split(";", 1)[0].strip() for r in ok if r.header)
    if paths:
        out["plans"] = dict(paths)  # x-disagg-path's first field: transfer, recompute, colocated
        out["path_header_example"] = next(r.header for r in ok if r.header)
        reasons = Counter(
            h.split("reason=", 1)[1].split(";", 1)[0] for r in ok if "reason=" in (h := r.header)
        )
        out["reasons"] = dict(reasons)
        if cell.topology == "pd":
            out["transfer_share"] = paths.get("transfer", 0) / len(ok)
    if samples:
        lat = [s[1] for s in samples]
        starts = [s[0] for s in samples]
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        out["probe_n"] = len(lat)
        out["probe_max_ms"] = 1000 * max(lat)
        out["probe_p99_ms"] = 1000 * percentile(lat, 99)
        out["probe_max_gap_ms"] = 1000 * max(gaps) if gaps else 0.0
    return out


def warm(target: Target, urls: list[str], cell: Cell, n: int, min_s: float = 0.0) -> None:
    """``n`` uncounted requests, repeated until ``min_s`` seconds have passed."""
    w = Cell("warm", cell.topology, min(cell.concurrency, 8), n, cell.max_tokens, cell.prompt_chars)
    reqs = request_bytes(urls[0], w, distinct_prompts(w), seed=9 * 10**6)  # prompts no counted request uses
    t0 = time.monotonic()
    while True:
        loadgen.run(lambda: loadgen.closed_loop(urls, reqs, 4, n))
        if time.monotonic() - t0 >= min_s:
            return


def profile_cell(cell: Cell, target: Target, out: Path) -> dict[str, Any]:
    """Run ``cell`` again with py-spy sampling the proxy (not counted in the results): top functions by self time."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if target.proc is None or not Path(spy).exists():
        return {"error": "py-spy not found (pip install py-spy)"}
    raw = out.with_suffix(".collapsed")
    cmd = [spy, "record", "--pid", str(target.proc.pid), "--format", "raw", "--rate", "500"]
    cmd += ["--output", str(raw)]  # blocking samples: exact stacks (the pauses cost the proxy, not counted)
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    short = cell.prompt_chars == 0 and cell.max_tokens <= 64  # the stream cells: thousands a second
    repeat = max(5 * cell.requests, 10_000 if short else 100)
    run_cell(replace(cell, requests=repeat), target, [target.url], None, run=1)  # new prompts: none cached
    spy_proc.send_signal(signal.SIGINT)
    try:
        spy_proc.wait(30)
    except subprocess.TimeoutExpired:
        spy_proc.kill()
    if not raw.exists():
        return {"error": (spy_proc.stderr.read() if spy_proc.stderr else b"").decode()[-500:]}
    self_t: Counter[str] = Counter()  # per function (lines merged)
    by_file: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        total += c
        self_t[frames[-1]] += c
        by_file[frames[-1].rpartition(" (")[2].rstrip(")")] += c
        for f in set(frames):
            incl[f] += c
    if not total:
        return {"error": "no samples"}
    pct = lambda c: 100 * c / total  # noqa: E731
    lines = [
        f"py-spy of the proxy during a repeat of cell {cell.name} ({total} samples)",
        "self time by function:",
    ]
    lines += [f"  {pct(c):5.1f}%  {f}" for f, c in self_t.most_common(30)]
    lines += ["self time by file:"] + [f"  {pct(c):5.1f}%  {f}" for f, c in by_file.most_common(25)]
    lines += ["inclusive time:"] + [f"  {pct(c):5.1f}%  {f}" for f, c in incl.most_common(60)]
    out.write_text("\n".join(lines) + "\n")
    return {
        "samples": total,
        "self_top": [(f, round(pct(c), 1)) for f, c in self_t.most_common(10)],
        "by_file_top": [(f, round(pct(c), 1)) for f, c in by_file.most_common(10)],
        "file": str(out),
    }


# ---------------------------------------------------------------------------------------------------- main


CELLS = {
    "c1": lambda n, nb, nl: Cell("stream c=1", "colo", 1, n, 16, 0),
    "c16": lambda n, nb, nl: Cell("stream c=16", "colo", 16, n, 16, 0),
    "c64": lambda n, nb, nl: Cell("stream c=64", "colo", 64, n, 16, 0),
    "pd": lambda n, nb, nl: Cell("P/D transfer c=16", "pd", 16, n, 16, PD_PROMPT_CHARS),
    "pdc": lambda n, nb, nl: Cell("P/D prompts colocated c=16", "colo", 16, n, 16, PD_PROMPT_CHARS),
    "big": lambda n, nb, nl: Cell("200 KB prompt c=2", "colo", 2, nb, 16, 200_000, probe=True),
    "long": lambda n, nb, nl: Cell("1000 chunks c=8", "colo", 8, nl, 1000, 0),
}


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    rows = []
    for cell, per in results.items():
        d = per.get("direct", {})
        vr = per.get("vllm-router", {})
        for name, r in per.items():
            row = {
                "cell": cell,
                "target": name,
                "req/s": _fmt(r.get("rps"), 0),
                "TTFT p50 ms": _fmt(r.get("ttft_p50_ms"), 2),
                "added p50 ms": ""
                if name == "direct"
                else _fmt(r["ttft_p50_ms"] - d.get("ttft_p50_ms", math.nan), 2),
                "added p99 ms": ""
                if name == "direct"
                else _fmt(r["ttft_p99_ms"] - d.get("ttft_p99_ms", math.nan), 2),
                "CPU µs/req": _fmt(r.get("cpu_us_per_req"), 0),
                "×router CPU": "",
                "×router req/s": "",
                "notes": "",
            }
            if name.startswith("vllm-disagg") and vr:
                if vr.get("cpu_us_per_req"):
                    row["×router CPU"] = _fmt(r.get("cpu_us_per_req", 0) / vr["cpu_us_per_req"], 2)
                if vr.get("rps"):
                    row["×router req/s"] = _fmt(r.get("rps", 0) / vr["rps"], 2)
            notes = []
            if "cpu_us_per_chunk" in r:
                notes.append(
                    f"{r['cpu_us_per_chunk']:.1f} µs/chunk ({r.get('kernel_pct', 0):.0f}% in the kernel)"
                )
            if "transfer_share" in r:
                notes.append(f"transfer plans {100 * r['transfer_share']:.0f}%")
            if "probe_max_ms" in r:
                notes.append(f"/health probe max {r['probe_max_ms']:.1f} ms (p99 {r['probe_p99_ms']:.1f})")
            if r.get("core0_others_pct", 0) > 5 and r.get("core0_others_s", 0) > 0.025:  # beyond tick noise
                notes.append(f"NOT ALONE: others used {r['core0_others_pct']:.0f}% of core {ROUTER_CORE}")
            if r.get("core0_steal_pct", 0) > 5:  # the hypervisor ran another guest on the router's core
                notes.append(f"STOLEN: {r['core0_steal_pct']:.0f}% of core {ROUTER_CORE}")
            if r.get("errors"):
                notes.append(f"{r['errors']} errors {r.get('error_kinds', '')}")
            row["notes"] = "; ".join(notes)
            rows.append(row)
    cols = ["cell", "target", "req/s", "TTFT p50 ms", "added p50 ms", "added p99 ms", "CPU µs/req"]
    cols += ["×router CPU", "×router req/s", "notes"]
    return str(render_table(rows, cols))


def targets_check(
    results: dict[str, dict[str, dict[str, Any]]], worker_requests: dict[str, dict[str, float]] | None = None
) -> list[str]:
    """Issue #15's targets, where this run measured them: one line each, PASS/FAIL with the numbers."""

    def get(cell: str, target: str, key: str) -> float | None:
        v = results.get(cell, {}).get(target, {}).get(key)
        return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)

    lines = []

    def check(name: str, ok: bool, detail: str) -> None:
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")

    for cell in ("stream c=1", "stream c=16", "stream c=64"):
        ours, theirs = get(cell, "vllm-disagg", "cpu_us_per_req"), get(cell, "vllm-router", "cpu_us_per_req")
        if ours is not None:
            check(f"{cell}: CPU <= 300 us/req", ours <= 300, f"{ours:.0f} us")
        if ours is not None and theirs:
            check(f"{cell}: CPU <= 1.5x vllm-router", ours <= 1.5 * theirs, f"{ours / theirs:.2f}x")
    for cell in ("stream c=16", "stream c=64"):
        ours, theirs = get(cell, "vllm-disagg", "rps"), get(cell, "vllm-router", "rps")
        if ours is not None and theirs:
            check(f"{cell}: req/s >= 0.9x vllm-router", ours >= 0.9 * theirs, f"{ours / theirs:.2f}x")
    ours, direct = get("stream c=1", "vllm-disagg", "ttft_p50_ms"), get("stream c=1", "direct", "ttft_p50_ms")
    if ours is not None and direct is not None:
        check("stream c=1: added TTFT p50 <= 0.5 ms", ours - direct <= 0.5, f"{ours - direct:.2f} ms")
    chunk = get("1000 chunks c=8", "vllm-disagg", "cpu_us_per_chunk")
    if chunk is not None:
        check("relay <= 10 us/chunk", chunk <= 10, f"{chunk:.1f} us")
    pd, colo, share = (
        get("P/D transfer c=16", "vllm-disagg", "cpu_us_per_req"),
        get("P/D prompts colocated c=16", "vllm-disagg", "cpu_us_per_req"),
        get("P/D transfer c=16", "vllm-disagg", "transfer_share"),
    )
    if pd is not None and colo and share:
        # A local plan of the same prompt costs what the colocated cell measured, so were the P/D cell to mix plans
        # (it runs always-transfer: share 1), one transfer plan would cost (pd - (1 - share) * colo) / share.
        per_transfer = (pd - (1 - share) * colo) / share
        check(
            "transfer-plan request <= 2x a colocated one of the same prompt (CPU)",
            per_transfer <= 2 * colo,
            f"{per_transfer:.0f} us vs {colo:.0f} us: {per_transfer / colo:.2f}x",
        )
    one, two = (
        get("stream c=16", "vllm-disagg", "cpu_us_per_req"),
        get("stream c=16", "vllm-disagg-w2", "cpu_us_per_req"),
    )
    if one and two is not None:
        check(
            "--workers 2: CPU per request within 15% of one worker's (c=16)",
            two <= 1.15 * one,
            f"{two / one:.2f}x",
        )
    shares = (worker_requests or {}).get("colo")
    if shares is not None:
        check(
            "--workers 2: both workers took requests (/metrics)",
            len(shares) == 2 and all(v > 0 for v in shares.values()),
            ", ".join(f"worker {w}: {v:.0f}" for w, v in sorted(shares.items())),
        )
    lag = get("200 KB prompt c=2", "vllm-disagg", "loop_lag_max_le_ms")
    if lag is not None:
        low = get("200 KB prompt c=2", "vllm-disagg", "loop_lag_max_gt_ms") or 0.0
        big: dict[str, Any] = results.get("200 KB prompt c=2", {}).get("vllm-disagg", {})
        detail = (
            f"worst lag in ({low:g}, {lag:g}] ms, {big['loop_lag_over_2ms']:g} of {big['loop_lag_samples']:g} "
            "samples over 2 ms"
        )
        if "canary_lag_max_le_ms" in big:
            rt = "real-time" if big.get("canary_realtime") else "plain"
            detail += (
                f"; a loop with no work on the same core ({rt} priority, same monitor): worst in "
                f"({big['canary_lag_max_gt_ms']:g}, {big['canary_lag_max_le_ms']:g}] ms, "
                f"{big['canary_lag_over_2ms']:g} of {big['canary_lag_samples']:g} over 2 ms"
            )
        elif "canary_error" in big:
            detail += f"; no host floor: {big['canary_error']}"
        check(
            "no event-loop stall > 2 ms with 200 KB prompts (the proxy's own loop-lag histogram)",
            lag <= 2,
            detail,
        )
    stall = get("200 KB prompt c=2", "vllm-disagg", "probe_max_ms")
    if stall is not None:
        check(
            "no event-loop stall > 2 ms with 200 KB prompts (/health probe max, from core 1)",
            stall <= 2,
            f"{stall:.1f} ms",
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "mode", nargs="?", choices=["mock"], help="accepted for compatibility (always mock backends)"
    )
    ap.add_argument("--cells", default="c1,c16,c64,pd,pdc,big,long", help=f"comma list of {','.join(CELLS)}")
    ap.add_argument("-n", "--requests", type=int, default=2000, help="requests per cell (c1/c16/c64/pd)")
    ap.add_argument(
        "--big-requests",
        type=int,
        default=256,
        help="requests in the 200 KB cell (CPU is read in 10 ms ticks)",
    )
    ap.add_argument("--long-requests", type=int, default=64, help="requests in the 1,000-chunk cell")
    ap.add_argument("--warmup", type=int, default=100, help="uncounted requests before each target's cells")
    ap.add_argument("--quick", action="store_true", help="smoke run: 300/8/8 requests, warm-up 20")
    ap.add_argument(
        "--targets",
        default="direct,vllm-disagg,vllm-disagg-w2,vllm-router",
        help="vllm-disagg-w2: the proxy with --workers 2 (both workers on the router's core); vllm-disagg:POLICY: "
        "the proxy with --policy POLICY, beside the default (the --both cells only)",
    )
    ap.add_argument("--no-vllm-router", action="store_true", help="skip vllm-router")
    ap.add_argument("--vllm-router", default=None, help="vllm-router binary (default: installed into "
                    ".artifacts/vllm-router-venv when absent)")  # fmt: skip
    ap.add_argument(
        "--router-policy", default="round_robin", help="vllm-router's --policy (its own default: cache_aware)"
    )
    ap.add_argument("--profile", default=None, help="write a py-spy profile of the proxy during c16 here")
    ap.add_argument(
        "--profile-cell", default="stream c=16", help="the cell --profile repeats (its name in the table)"
    )
    ap.add_argument(
        "--profile-target",
        default="vllm-disagg",
        help="the target --profile samples (e.g. vllm-disagg:least-loaded)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--logdir", default=str(ROOT / ".artifacts" / "bench-proxy-logs"))
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.requests, ns.big_requests, ns.long_requests, ns.warmup = 200, 4, 4, 10
    cells = {k: CELLS[k](ns.requests, ns.big_requests, ns.long_requests) for k in ns.cells.split(",") if k}
    targets = [t for t in ns.targets.split(",") if t and not (t == "vllm-router" and ns.no_vllm_router)]
    if not TOKENIZER.exists():
        print(f"{TOKENIZER} missing: build it with `make demo` (or scripts/setup.sh)", file=sys.stderr)
        return 2
    if os.cpu_count() and (os.cpu_count() or 0) < 2:
        print("needs 2 cores (router on core 0, everything else on core 1)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop what was started
    os.sched_setaffinity(0, {CLIENT_CORE})  # this process, the load generator and the backends
    logdir = Path(ns.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    router_info = None
    if "vllm-router" in targets:
        router_info = ensure_vllm_router(ns.vllm_router)
        if router_info is None:
            print("vllm-router not available; skipping it", file=sys.stderr)
            targets.remove("vllm-router")
    pa, pb, side = free_port(), free_port(), free_port()
    backends = [start_backend(pa, side, logdir), start_backend(pb, None, logdir)]
    a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    results: dict[str, dict[str, dict[str, Any]]] = {c.name: {} for c in cells.values()}
    meta: dict[str, Any] = {"targets": {}}
    busy = subprocess.run(["pgrep", "-f", "bench serve|benchmarks/e2e.py"], capture_output=True, text=True)
    meta["machine_quiet"] = not busy.stdout.strip()
    loadavg = Path("/proc/loadavg").read_text().split()[:3]
    t_start = time.time()
    try:
        for topology in ("colo", "pd"):
            tcells = [c for c in cells.values() if c.topology == topology]
            if not tcells:
                continue
            for tname in targets:
                target: Target
                if tname == "direct":
                    target = Target("direct", a)
                    urls = [a, b] if topology == "colo" else [b]
                elif tname == "vllm-disagg":
                    target = start_proxy(topology, a, b, side, logdir)
                    urls = [target.url]
                elif tname == "vllm-disagg-w2":
                    target = start_proxy(topology, a, b, side, logdir, workers=2)
                    urls = [target.url]
                elif tname.startswith("vllm-disagg:"):  # an A/B of another policy (streamed cells only)
                    if topology != "colo":
                        continue
                    target = start_proxy(topology, a, b, side, logdir, policy=tname.partition(":")[2])
                    urls = [target.url]
                elif tname == "vllm-router":
                    assert router_info is not None
                    target = start_vllm_router(router_info[0], topology, a, b, logdir, ns.router_policy)
                    urls = [target.url]
                else:
                    raise SystemExit(f"unknown target {tname}")
                meta["targets"][f"{tname}/{topology}"] = target.extra
                try:
                    # At least 2 s: a proxy's first second also runs its first metrics flush and, with
                    # --workers, every worker's first requests (the kernel picks which worker a connection
                    # reaches): a first cell of 2,000 short requests lasts a quarter of a second.
                    warm(target, urls, tcells[0], ns.warmup, min_s=0.0 if ns.quick else 2.0)
                    for cell in tcells:
                        if cell.max_tokens >= 256 or cell.prompt_chars >= 100_000:
                            warm(target, urls, cell, 2)
                        pid = target.proc.pid if target.proc else None
                        r = run_cell(cell, target, urls, pid)
                        results[cell.name][tname] = r
                        print(f"  {cell.name:<20} {tname:<12} {json.dumps(_short(r))}", file=sys.stderr)
                        if ns.profile and tname == ns.profile_target and cell.name == ns.profile_cell:
                            meta["profile"] = profile_cell(cell, target, Path(ns.profile))
                    if tname == "vllm-disagg-w2":
                        meta.setdefault("worker_requests", {})[topology] = worker_shares(target.url)
                finally:
                    stop(target.proc)
    finally:
        meta["backend_stats"] = {}
        for name, url in (("A", a), ("B", b)):
            status, raw = _get(url + "/mock/stats")
            meta["backend_stats"][name] = json.loads(raw) if status == 200 else None
        for p in backends:
            stop(p)
    busy = subprocess.run(["pgrep", "-f", "bench serve|benchmarks/e2e.py"], capture_output=True, text=True)
    meta["machine_quiet"] = meta["machine_quiet"] and not busy.stdout.strip()
    cpu = cpu_description(Path("/proc/cpuinfo").read_text())
    paths = ", ".join(
        sorted({str(t.get("request_path")) for t in meta["targets"].values() if "request_path" in t})
    )
    header = (
        f"router overhead: router alone on core {ROUTER_CORE}, load generator + 2 fast backends on core "
        f"{CLIENT_CORE}; vllm-disagg default policy; vllm-router "
        f"{router_info[1] if router_info else '(skipped)'} --policy {ns.router_policy}; "
        f"vllm-disagg request path {paths}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t_start))}, {time.time() - t_start:.0f} s, "
        f"loadavg at start {' '.join(loadavg)}, machine {'quiet' if meta['machine_quiet'] else 'BUSY'}; "
        f"CPU {cpu['cpu_model']} ({cpu['cpu_isa']})"
    )
    print(header)
    print(table(results))
    print(
        "added TTFT = target percentile - direct percentile in the same cell (not paired); CPU µs/req = router "
        "utime+stime (/proc/<pid>/stat, process tree) over the cell / requests"
    )
    checks = targets_check(results, meta.get("worker_requests"))
    if checks:
        print("issue #15 targets:")
        print("\n".join(checks))
    if "profile" in meta and "error" in meta["profile"]:
        print(f"no py-spy profile: {meta['profile']['error']}")
    elif "profile" in meta:
        prof = meta["profile"]
        print(f"py-spy, proxy at c=16, top self time ({prof.get('samples', 0)} samples):")
        for f, share in prof.get("self_top", []):
            print(f"  {share:5.1f}%  {f}")
        print("  by file:", ", ".join(f"{f} {share}%" for f, share in prof.get("by_file_top", [])))
    if ns.json:
        doc = {
            "machine": machine_info(),
            "header": header,
            "vllm_router_version": router_info[1] if router_info else None,
            "meta": meta,
            "cells": {k: vars(c) for k, c in cells.items()},
            "results": results,
            "targets": checks,
        }
        Path(ns.json).write_text(json.dumps(doc, indent=2, default=str))
    return 0


def _short(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("rps", "ttft_p50_ms", "cpu_us_per_req", "errors", "transfer_share", "probe_max_ms")
    return {k: round(r[k], 2) if isinstance(r[k], float) else r[k] for k in keys if k in r}


if __name__ == "__main__":
    sys.exit(main())
