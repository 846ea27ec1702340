"""The fault wrappers on two real engines (the fault matrix drives the same wrappers inside vLLM processes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from support.transfer_engines import LAYERS, geometry, store, wait_results

from vllm_disagg.transport.engine import EngineSettings, TransferEngine
from vllm_disagg.transport.faults import FaultInjector, FaultySideChannel
from vllm_disagg.transport.records import RecvRecord, SendOutcome, SendRecord


def _pair(rules: Path, **settings: object) -> tuple[TransferEngine, TransferEngine]:
    opts: dict[str, object] = dict(bind_host="127.0.0.1", transport="tcp", load_timeout_s=10.0, lease_s=10.0)
    opts.update(settings)
    engines = []
    for name, seed in (("P", 1), ("D", None)):
        wrap = FaultySideChannel.wrapper(FaultInjector(str(rules)))
        engines.append(
            TransferEngine(store(seed), geometry(), name, EngineSettings(**opts), wrap_channel=wrap)  # type: ignore[arg-type]
        )
    return engines[0], engines[1]


def _transfer(p: TransferEngine, d: TransferEngine, tid: str) -> set[str]:
    p.begin_send(tid, "rp", prompt_len=8)
    d.start_load("rd", tid, ("127.0.0.1", p.port), [4, 5], first_block=0, prompt_len=8)
    time.sleep(0.2)
    for layer in range(LAYERS):
        p.offer_blocks(tid, layer, [(0, 1), (1, 2)], "rp")
    return wait_results(d, lambda r: "rd" in r.finished_recving).failed_recving


def test_a_corrupted_layer_fails_the_load_when_checksums_are_on(tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"on": "layer", "action": "corrupt", "every": 2}]))
    p, d = _pair(rules, verify_checksums=True)
    try:
        assert _transfer(p, d, "t") == {"rd"}
        (recv,) = d.drain_records()
        assert isinstance(recv, RecvRecord) and "checksum mismatch" in recv.reason
    finally:
        p.close()
        d.close()


def test_a_delayed_register_still_loads_and_dropped_dones_end_in_lease_expiry(tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(
        json.dumps([{"on": "register", "action": "delay", "delay_s": 0.3}, {"on": "done", "action": "drop"}])
    )
    p, d = _pair(rules, lease_s=1.0)
    try:
        assert _transfer(p, d, "t") == set()
        for layer in range(LAYERS):
            assert bytes(d.store.read(layer, 4)) == bytes(p.store.read(layer, 1))
        p.finish_send("t", aborted=False, request_id="rp")
        # No Done arrived: the lease freed the blocks.
        wait_results(p, lambda r: "rp" in r.finished_sending, timeout=5)
        (send,) = p.drain_records()
        assert isinstance(send, SendRecord) and send.outcome is SendOutcome.LEASE_EXPIRED
    finally:
        p.close()
        d.close()


def test_slow_steps_sleeps_before_each_step(tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"on": "step", "action": "delay", "delay_s": 0.2}]))
    calls: list[int] = []
    step = FaultInjector(str(rules)).slow_steps(calls.append)
    t0 = time.monotonic()
    step(1)
    assert calls == [1] and time.monotonic() - t0 >= 0.2
