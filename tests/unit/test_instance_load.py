"""An instance's load between /metrics probes: vLLM's last report moved by what this proxy sent since."""

from __future__ import annotations

from vllm_disagg.policy.api import ClusterView, RequestView
from vllm_disagg.policy.builtin import LeastLoaded
from vllm_disagg.router.config import InstanceConfig
from vllm_disagg.router.instances import Instance


def _instance(name: str) -> Instance:
    return Instance(cfg=InstanceConfig(url=f"http://{name}:1", role="both", id=name), id=name, healthy=True)


def test_requests_sent_since_the_report_wait_then_run_then_leave() -> None:
    a = _instance("a")
    a.report_load(waiting=2, running=1, kv_usage=0.0)
    a.acquire()
    a.acquire()
    assert (a.waiting_now, a.running_now) == (4, 1)
    a.started()
    assert (a.waiting_now, a.running_now) == (3, 2)
    a.release(streaming=True)
    a.release()  # ended before its first token (an error, a non-streamed answer)
    assert (a.waiting_now, a.running_now) == (2, 1)


def test_the_view_carries_the_lengths_of_the_streams_whose_clients_set_one() -> None:
    a = _instance("a")
    for tokens in (16, 128, 0):  # 0: the client set no max_tokens
        a.acquire()
        a.started(tokens=tokens)
    v = a.view(0.0)
    assert (v.running, v.known_streams, v.shortest_stream) == (3, 2, 16)
    assert abs(v.stall_sensitivity - (1 / 15 + 1 / 127)) < 1e-12
    a.release(streaming=True, tokens=16)
    v = a.view(0.0)
    assert (v.running, v.known_streams, v.shortest_stream) == (2, 1, 128)
    a.release(streaming=True, tokens=128)
    a.release(streaming=True, tokens=0)
    v = a.view(0.0)
    assert (v.running, v.known_streams, v.shortest_stream, v.stall_sensitivity) == (0, 0, 0, 0.0)


def test_a_report_that_already_counted_this_proxys_requests_is_not_moved_by_them_again() -> None:
    a = _instance("a")
    a.acquire()
    a.acquire()
    a.started()
    a.report_load(waiting=1, running=1, kv_usage=0.0)  # vLLM sees the proxy's two requests
    assert (a.waiting_now, a.running_now) == (1, 1)
    a.release(streaming=True)
    assert (a.waiting_now, a.running_now) == (1, 0)
    a.release()
    assert (a.waiting_now, a.running_now) == (0, 0)
    a.acquire()  # a request that began before the report and ended since cannot push a count below zero
    a.report_load(waiting=0, running=0, kv_usage=0.0)
    a.started()
    a.release(streaming=True)
    assert (a.waiting_now, a.running_now) == (0, 0)


def test_least_loaded_sees_streams_that_ended_since_the_last_probe() -> None:
    """Three streams on ``a`` at the probe have ended; ``b`` has one that began since. A balancer reading the
    report picks ``b``, the busier one; the estimate picks ``a``."""
    a, b = _instance("a"), _instance("b")
    for _ in range(3):
        a.acquire()
        a.started()
    a.report_load(waiting=0, running=3, kv_usage=0.0)
    b.report_load(waiting=0, running=0, kv_usage=0.0)
    for _ in range(3):
        a.release(streaming=True)
    b.acquire()
    b.started()
    view = ClusterView((a.view(0.0), b.view(0.0)))
    assert [(i.id, i.waiting, i.running, i.in_flight) for i in view.instances] == [
        ("a", 0, 0, 0),
        ("b", 0, 1, 1),
    ]
    assert LeastLoaded().plan(RequestView("r", 100), view).decode == "a"


def test_a_prompt_being_computed_waits_though_vllm_counts_it_running() -> None:
    """vLLM counts a prompt being computed as running; here it waits until its answer begins. A transfer's prefill
    leg never begins one there, so a split's prefill instance shows no streams (its stall would otherwise count
    against streams that do not exist)."""
    p = _instance("p")
    p.acquire()
    p.report_load(waiting=0, running=1, kv_usage=0.0)  # the leg, prefilling
    p.acquire()
    assert (p.waiting_now, p.running_now, p.in_flight) == (2, 0, 2)
    p.release()
    p.release()
    assert (p.waiting_now, p.running_now, p.in_flight) == (0, 0, 0)


def test_other_senders_requests_come_from_the_report() -> None:
    """Whatever the report holds beyond this process's requests is someone else's (another worker or replica, a
    direct client), split into waiting and running as the report has it; at the report both views agree."""
    a = _instance("a")
    a.acquire()
    a.acquire()
    a.started()
    a.report_load(
        waiting=3, running=4, kv_usage=0.0
    )  # this process's 2 (one computing its prompt) and 5 others
    assert (a.waiting_now, a.running_now) == (3, 4)
    a.release(streaming=True)
    a.release()
    assert (a.waiting_now, a.running_now) == (2, 3)


def test_a_decode_leg_waiting_for_its_kv_is_no_prompt_to_compute() -> None:
    """A transfer's decode leg computes nothing here before its KV arrives: a queue of them does not delay a prompt
    sent here, so it is not counted as waiting; once its first token comes it is a stream."""
    d = _instance("d")
    d.acquire(load=True)
    d.acquire(load=True)
    assert (d.waiting_now, d.running_now, d.in_flight) == (0, 0, 2)
    d.started(load=True)
    assert (d.waiting_now, d.running_now) == (0, 1)
    d.release(streaming=True, load=True)
    d.release(load=True)  # its hand-off failed before a first token
    assert (d.waiting_now, d.running_now, d.in_flight, d.own_loads) == (0, 0, 0, 0)
