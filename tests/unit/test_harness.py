"""The harness kills whole process groups, including grandchildren, and reports a failed start with the log."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from vllm_disagg.tools.harness import ServerStartError, VLLMServer


class _FakeServer(VLLMServer):
    """Runs a shell that spawns a grandchild and never serves /health (or exits at once)."""

    script: str = "sleep 300 & echo child $! ; sleep 300"

    def command(self) -> list[str]:
        return ["bash", "-c", self.script]


def _pids_in_group(pgid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    pids.append(int(d.name))
            except ProcessLookupError:
                continue
    return pids


def _wait_group(pgid: int, n: int) -> list[int]:
    """The group's pids once it has ``n`` (the shell has forked its child)."""
    deadline = time.monotonic() + 10
    while len(pids := _pids_in_group(pgid)) < n:
        assert time.monotonic() < deadline, pids
        time.sleep(0.05)
    return pids


def test_stop_kills_grandchildren() -> None:
    s = _FakeServer("unused", name="fake").start()
    assert s.proc is not None
    _wait_group(s.proc.pid, 2)
    s.stop(grace=1.0)
    assert _pids_in_group(s.proc.pid) == []


def test_failed_start_raises_with_log_tail() -> None:
    s = _FakeServer("unused", name="fake")
    s.script = "echo 'boom: bad flag --nope' ; exit 3"
    s.start()
    with pytest.raises(ServerStartError, match="boom: bad flag") as err:
        s.wait_healthy(timeout=20)
    assert "code 3" in str(err.value)


def test_deadline_raises_and_cleans_up() -> None:
    s = _FakeServer("unused", name="fake").start()
    with pytest.raises(ServerStartError, match="not healthy after"):
        s.wait_healthy(timeout=1.5)
    assert s.proc is not None and _pids_in_group(s.proc.pid) == []


def test_child_dies_with_parent(tmp_path: Path) -> None:
    # A parent that is SIGKILLed (no atexit) still takes its server with it (PR_SET_PDEATHSIG).
    code = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_harness import _FakeServer\n"
        "s = _FakeServer('unused', name='fake')\n"
        "s.script = 'exec sleep 60'\n"
        "s.start()\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    import subprocess

    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} outlived its SIGKILLed parent")


def test_cpu_cores_pin_the_whole_process_group() -> None:
    """Every process of the instance (here a shell and its child) runs only on the instance's cores, and
    VLLM_CPU_OMP_THREADS_BIND names the same ones."""
    from vllm_disagg.tools.harness import cpu_list

    assert cpu_list("0") == {0} and cpu_list("0-2,5") == {0, 1, 2, 5} and cpu_list("1, 3") == {1, 3}
    core = min(os.sched_getaffinity(0))
    s = _FakeServer("unused", name="fake-pinned", cpu_cores=str(core)).start()
    try:
        assert s.proc is not None
        pids = _wait_group(s.proc.pid, 2)
        assert all(os.sched_getaffinity(pid) == {core} for pid in pids)
        assert s.environment()["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
    finally:
        s.stop(grace=1.0)
    # cores this process may not use are not asked for (the instance then runs unpinned)
    assert VLLMServer("unused", cpu_cores="4096").pinned_cores() is None
