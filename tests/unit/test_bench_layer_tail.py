"""The layer-tail benchmark's arithmetic: which offer times a layer's transfer, and what the tail is measured from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from layer_tail import tail_figures  # noqa: E402


def _records(offers: list[float], done: list[float], t_start: float, t_done: float) -> tuple[dict, dict]:
    send = {"transfer_id": "t", "layer_offer_times": offers, "t_last_send": offers[-1] + 0.001}
    recv = {"state": "done", "bytes": 4096, "layer_done_times": done, "t_start": t_start, "t_done": t_done}
    return send, recv


def test_layers_are_timed_from_the_last_chunks_offers_and_the_tail_from_the_last_layer() -> None:
    # Two chunks of 4 layers: the first chunk's offers (0.0-0.3) do not time anything.
    offers = [0.0, 0.1, 0.2, 0.3, 1.0, 1.1, 1.2, 1.3]
    done = [1.004, 1.105, 1.203, 1.3035]
    send, recv = _records(offers, done, t_start=-0.5, t_done=1.305)
    f = tail_figures(send, recv, num_layers=4)
    assert f["per_layer_s"] == pytest.approx([0.004, 0.005, 0.003, 0.0035])
    assert f["layer_s"] == pytest.approx(0.004)  # median of the layers before the last
    assert f["tail_s"] == pytest.approx(0.005)  # decode's end - the last layer's offer
    assert f["registered_first"] and f["meets_target"]
    parts = f["tail_parts_s"]
    assert parts["prefill_send"] == pytest.approx(0.001) and parts["decode_finish"] == pytest.approx(0.0015)
    assert sum(parts.values()) == pytest.approx(f["tail_s"])


def test_a_tail_past_one_layer_plus_two_ms_misses_and_a_late_registration_is_marked() -> None:
    send, recv = _records([0.0, 0.1], [0.011, 0.2], t_start=0.05, t_done=0.1135)
    f = tail_figures(send, recv, num_layers=2)
    assert f["layer_s"] == pytest.approx(0.011)
    assert f["tail_s"] == pytest.approx(0.0135) and not f["meets_target"]
    assert not f["registered_first"]


def test_an_incomplete_load_is_refused() -> None:
    send, recv = _records([0.0, 0.1], [0.01, 0.0], t_start=-1, t_done=0.2)
    with pytest.raises(ValueError, match="not a complete"):
        tail_figures(send, recv, num_layers=2)
    send, recv = _records([0.0, 0.1], [0.01, 0.11], t_start=-1, t_done=0.2)
    recv["state"] = "failed"
    with pytest.raises(ValueError):
        tail_figures(send, recv, num_layers=2)
