"""benchmarks/stack_cpu.py: CPU attributed to the right role from real processes, and /proc parsing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import stack_cpu  # noqa: E402

# A parent that idles while its child spins for ``SPIN`` seconds of CPU, then both wait to be killed.
SPIN = 0.6
_TREE = textwrap.dedent(
    f"""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import time\\nt = time.process_time()\\nwhile time.process_time() - t < {SPIN}: pass\\n"
        "print('spun', flush=True)\\ntime.sleep(60)"], stdout=sys.stdout)
    print('started', flush=True)
    time.sleep(60)
    """
)


def test_parse_stat_survives_spaces_and_parens_in_the_name() -> None:
    text = "123 (a (weird) name) S 45 1 1 0 -1 0 0 0 0 0 250 50 0 0 20 0 1 0 1 0 0"
    parent, cpu = stack_cpu.parse_stat(text)
    assert parent == 45
    assert abs(cpu - 300 / stack_cpu._TICK) < 1e-9


def test_attribute_splits_an_instance_into_api_server_and_engine() -> None:
    # pid: (parent, cpu): instance root 10 with engine 11 and its worker 12; proxy 20 with a helper 21; 30 not ours
    table = {10: (1, 1.0), 11: (10, 5.0), 12: (11, 2.0), 20: (1, 0.5), 21: (20, 0.25), 30: (1, 9.0)}
    got = stack_cpu.attribute(table, {"both-a": 10, "proxy": 20}, frozenset({"both-a"}))
    assert got == {"both-a/api": 1.0, "both-a/engine": 7.0, "proxy": 0.75}


def test_a_spinning_child_counts_as_its_instance_engine_and_the_cores_as_busy() -> None:
    tree = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert tree.stdout is not None
        assert tree.stdout.readline().strip() == "started"
        cpu = stack_cpu.StackCpu({"inst": tree.pid}, frozenset({"inst"}), interval_s=0.05)
        cpu.start()
        assert tree.stdout.readline().strip() == "spun"
        time.sleep(0.1)
        got = cpu.stop()
    finally:
        tree.kill()
        tree.wait()
    roles = got["cpu_s"]
    assert isinstance(roles, dict)
    # the child's spin (less what it did before start(), at most a few ticks) is the engine's; the idle parent is not
    assert roles["inst/engine"] >= SPIN / 2
    assert roles.get("inst/api", 0.0) < SPIN / 4
    busy = got["core_busy"]
    assert isinstance(busy, list) and busy and all(0.0 <= b <= 1.0 for b in busy)
    assert sum(busy) > 0.0


def test_other_children_of_this_process_are_the_client() -> None:
    table = {100: (1, 3.0), 101: (100, 2.0), 102: (101, 0.5), 10: (100, 1.0), 11: (10, 4.0)}
    got = stack_cpu.attribute(table, {"a": 10}, frozenset({"a"}), me=100)
    assert got == {"a/api": 1.0, "a/engine": 4.0, "client": 2.5}  # this process itself (3.0) is no one's


def test_samples_cut_to_a_window_interpolate_and_never_go_back() -> None:
    s = stack_cpu.Samples()
    s.add(0.0, {"a": 0.0}, [(0, 0)])
    s.add(1.0, {"a": 1.0, "client": 2.0}, [(50, 100)])
    s.add(2.0, {"a": 3.0}, [(150, 200)])  # the client exited: its CPU left /proc, its counter stays at 2.0
    got = s.between(0.5, 1.5)
    # a: 0.5 -> 2.0; client: 1.0 (a role seen late starts at 0) -> 2.0
    assert got["cpu_s"] == {"a": 1.5, "client": 1.0}
    assert got["core_busy"] == [0.75]  # ticks 25 -> 100 busy of 50 -> 150 total
    assert got["cpu_window_s"] == 1.0
    assert (
        stack_cpu.at([0.0, 1.0], [0.0, 10.0], 5.0) == 10.0
        and stack_cpu.at([0.0, 1.0], [0.0, 10.0], -1) == 0.0
    )


def test_busy_share_reads_each_cpu_between_two_readings(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 80 0 0 0 0 0 0\ncpu0 5 0 5 40 0 0 0 0 0 0\ncpu1 5 0 5 40 0 0 0 0 0 0\n")
    before = stack_cpu.core_ticks(stat)
    stat.write_text("cpu  0 0 0 0 0 0 0 0 0 0\ncpu0 55 0 5 40 0 0 0 0 0 0\ncpu1 5 0 5 90 10 0 0 0 0 0\n")
    after = stack_cpu.core_ticks(stat)
    s = stack_cpu.Samples()
    s.add(0.0, {}, before)
    s.add(1.0, {}, after)
    assert s.between(0.0, 1.0)["core_busy"] == [1.0, 0.0]  # cpu1's iowait is not busy


def test_descendants_and_a_partial_table_read_only_this_tree() -> None:
    table = {1: (0, 0.0), 100: (1, 1.0), 101: (100, 1.0), 102: (101, 1.0), 200: (1, 5.0)}
    assert stack_cpu.descendants(table, 100) == {100, 101, 102}
    me = os.getpid()
    got = stack_cpu.process_table({me, 2**22 + 7})  # a pid that does not exist is left out
    assert set(got) == {me} and got[me][0] == os.getppid()


def test_foreign_cpu_counts_a_short_lived_job_outside_our_tree_and_not_our_own() -> None:
    """Other jobs' CPU over a point: a process that starts and ends between two readings still counts (a process
    table read at both ends never sees it), and a child of ours that came and went does not."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    me = os.getpid()

    def background_over(wall: float) -> float:
        """What other jobs on this machine spend over ``wall`` seconds: the allowance for a busy machine."""
        before = stack_cpu.foreign_cpu_s(me)
        time.sleep(wall)
        return stack_cpu.foreign_cpu_s(me) - before

    for _ in range(3):  # other jobs' load is not steady: a burst beside one reading is not ours
        t0, before = time.monotonic(), stack_cpu.foreign_cpu_s(me)
        subprocess.run([sys.executable, "-c", spin], check=True)  # ours: reaped into our cutime
        ours, wall = stack_cpu.foreign_cpu_s(me) - before, time.monotonic() - t0
        background = max(background_over(wall), background_over(wall))
        if ours < 0.3 + 2 * background:
            break
    # a job outside our tree: double fork, the spinner reparented away from us, gone before we read again
    detach = (
        f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {spin!r}], start_new_session=True)"
    )
    before = stack_cpu.foreign_cpu_s(me)
    subprocess.run([sys.executable, "-c", detach], check=True)
    deadline = time.monotonic() + 10
    foreign = 0.0
    while time.monotonic() < deadline and foreign < 0.4:
        time.sleep(0.1)
        foreign = stack_cpu.foreign_cpu_s(me) - before
    assert foreign >= 0.4
    assert ours < 0.3 + 2 * background
