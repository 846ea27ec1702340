"""Where a benchmark point's CPU went: each vLLM instance's API server and engine, the proxy, the client, per core.

On this project's 2-core runs every process of the stack shares the engines' cores, so a design is slowed by the
stack's work as much as by its engines'. The simulator's replay charges that work per emitted token to the
instance emitting it; these figures say how much there was, whose it was, and how busy each core was, so the
replay's calibration can be held against them (``simulate --validate`` prints them).

Process CPU comes from /proc/<pid>/stat (utime + stime, in clock ticks) over a process and its descendants; a
vLLM instance's root process is its API server and every descendant (EngineCore and its workers) counts as its
engine; the client is whatever else runs under this process (``vllm bench serve``). A sampler thread reads them
every ``INTERVAL_S``, so the figures can be cut to the requests' own window (the client's start-up, which imports
vLLM, and its report are not its per-token cost): cumulative counters are interpolated at the window's edges.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from report import cpu_stat_fields

_TICK = os.sysconf("SC_CLK_TCK")
INTERVAL_S = 0.25
FULL_SCAN_EVERY = 8
CLIENT = "client"


def _stat_fields(text: str) -> list[str]:
    """The fields of one /proc/<pid>/stat line after the command name (which may hold spaces and parens)."""
    return text[text.rindex(")") + 2 :].split()


def _parent_and_cpu(fields: list[str]) -> tuple[int, float]:
    """(parent pid, CPU seconds) from a stat line's fields (``_stat_fields``)."""
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def parse_stat(text: str) -> tuple[int, float]:
    """(parent pid, CPU seconds) from one /proc/<pid>/stat line."""
    return _parent_and_cpu(_stat_fields(text))


def _stats(pids: set[int] | None, proc: Path) -> dict[int, list[str]]:
    """pid -> its /proc/<pid>/stat fields after the command name, for ``pids`` (None: every process) readable
    now."""
    out: dict[int, list[str]] = {}
    for pid in pids if pids is not None else (int(e) for e in os.listdir(proc) if e.isdigit()):
        try:
            out[pid] = _stat_fields((proc / str(pid) / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return out


def _table(stats: Mapping[int, list[str]]) -> dict[int, tuple[int, float]]:
    table: dict[int, tuple[int, float]] = {}
    for pid, fields in stats.items():
        try:
            table[pid] = _parent_and_cpu(fields)
        except (ValueError, IndexError):
            continue
    return table


def process_table(pids: set[int] | None = None, proc: Path = Path("/proc")) -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds) of ``pids`` (None: every process) readable now."""
    return _table(_stats(pids, proc))


def machine_task_cpu_s(stat: str | None = None) -> float:
    """CPU seconds every task on the machine has run so far, user and system: a process's own times count the
    same (interrupts and steal are in neither). ``stat``: /proc/stat's text (read now when None)."""
    return sum(cpu_stat_fields("cpu", stat)[:3]) / _TICK


def tree_cpu_s(root: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds ``root`` and every process under it have run, the exited ones included: each live process's
    own times plus its reaped children's (cutime, cstime), so a child that came and went between two readings
    still counts."""
    stats = _stats(None, proc)  # one read of each process: its parent and its times from the same line
    total = 0.0
    for pid in descendants(_table(stats), root):
        try:
            total += sum(int(f) for f in stats[pid][11:15]) / _TICK
        except (ValueError, IndexError):
            continue
    return total


def foreign_cpu_s(root: int) -> float:
    """CPU seconds run so far by everything outside ``root``'s tree: other jobs on the machine, short-lived ones
    included (a process table read at two moments misses whatever started and ended between them)."""
    return machine_task_cpu_s() - tree_cpu_s(root)


def descendants(table: Mapping[int, tuple[int, float]], root: int) -> set[int]:
    """``root`` and every process under it in ``table``."""
    out = set()
    for pid in table:
        node = pid
        while node > 1 and node in table and node != root:
            node = table[node][0]
        if node == root:
            out.add(pid)
    return out


def attribute(
    table: Mapping[int, tuple[int, float]],
    roots: Mapping[str, int],
    split: frozenset[str],
    me: int | None = None,
) -> dict[str, float]:
    """CPU seconds per role: each root's tree under its name, split for the roots in ``split`` into the root's own
    process (``<name>/api``) and its descendants (``<name>/engine``); with ``me``, the rest of that process's
    descendants (not ``me`` itself) as ``client``."""
    owner: dict[int, str] = {pid: name for name, pid in roots.items()}
    out: dict[str, float] = {}
    for pid, (_, cpu) in table.items():
        node, role = pid, None
        while node > 1 and node in table:
            if node in owner:
                name = owner[node]
                role = name if name not in split else f"{name}/api" if node == pid else f"{name}/engine"
                break
            if node == me:
                role = CLIENT if pid != me else None
                break
            node = table[node][0]
        if role is not None:
            out[role] = out.get(role, 0.0) + cpu
    return out


def core_ticks(stat: Path = Path("/proc/stat")) -> list[tuple[int, int]]:
    """(busy, total) jiffies per CPU: busy is everything but idle and iowait."""
    out = []
    for line in stat.read_text().splitlines():
        name, *rest = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        v = [int(x) for x in rest]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        total = sum(v[:8])  # guest time is already inside user
        out.append((total - idle, total))
    return out


def at(times: list[float], values: list[float], t: float) -> float:
    """A cumulative counter sampled at ``times`` (ascending), linearly interpolated at ``t`` (clamped)."""
    k = bisect.bisect_left(times, t)
    if k == 0:
        return values[0]
    if k >= len(times):
        return values[-1]
    t0, t1 = times[k - 1], times[k]
    w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
    return values[k - 1] + w * (values[k] - values[k - 1])


class Samples:
    """Cumulative CPU per role and busy/total ticks per core, sampled over time (pure: ``between`` is tested)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.roles: dict[str, list[float]] = {}
        self.cores: list[list[tuple[int, int]]] = []

    def add(self, t: float, roles: Mapping[str, float], cores: list[tuple[int, int]]) -> None:
        n = len(self.times)
        for name in roles.keys() - self.roles.keys():
            self.roles[name] = [0.0] * n  # a role seen late had used nothing before
        for name, series in self.roles.items():
            # a process that exited takes its CPU out of /proc: a counter never goes back
            series.append(max(roles.get(name, 0.0), series[-1] if series else 0.0))
        self.times.append(t)
        self.cores.append(cores)

    def between(self, start: float, end: float) -> dict[str, object]:
        """CPU seconds per role, each CPU's busy share and the seconds between ``start`` and ``end``."""

        def delta(series: list[float]) -> float:
            return at(self.times, series, end) - at(self.times, series, start)

        cpu = {name: round(delta(s), 3) for name, s in sorted(self.roles.items())}
        busy = []
        for c in range(len(self.cores[0]) if self.cores else 0):
            d_busy = delta([float(x[c][0]) for x in self.cores])
            d_tot = delta([float(x[c][1]) for x in self.cores])
            busy.append(round(d_busy / d_tot, 3) if d_tot > 0 else 0.0)
        return {"cpu_s": cpu, "core_busy": busy, "cpu_window_s": round(end - start, 3)}


class StackCpu:
    """Samples a design's processes and this process's other children in a thread, from ``start`` to ``stop``."""

    def __init__(
        self, roots: Mapping[str, int], split: frozenset[str], interval_s: float = INTERVAL_S
    ) -> None:
        self.roots, self.split, self.interval_s = dict(roots), split, interval_s
        self.samples = Samples()
        self._count = 0
        self._ours: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-cpu", daemon=True)

    def _sample(self) -> None:
        # every process is listed once every FULL_SCAN_EVERY samples (to find new ones, such as the client); in
        # between only this process's tree is read (~4 ms a full scan here, ~0.15 ms the tree alone)
        me = os.getpid()
        if self._count % FULL_SCAN_EVERY == 0:
            table = process_table()
            self._ours = descendants(table, me)
        else:
            table = process_table(self._ours)
        self._count += 1
        self.samples.add(time.monotonic(), attribute(table, self.roots, self.split, me), core_ticks())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self, window: tuple[float, float] | None = None) -> dict[str, object]:
        """The figures over ``window`` (``time.monotonic`` seconds; None: all the time sampled)."""
        self._stop.set()
        self._thread.join()
        self._sample()
        ts = self.samples.times
        start, end = window if window is not None else (ts[0], ts[-1])
        return self.samples.between(max(start, ts[0]), min(end, ts[-1]))
