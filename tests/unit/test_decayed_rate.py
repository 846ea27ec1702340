"""The policies' shared decayed accumulator: a steady stream reads as its rate, and a fresh one is not near 0."""

import math

import pytest

from vllm_disagg.policy.decayed import DecayedRate


def test_steady_events_read_as_their_rate() -> None:
    acc = DecayedRate(window_s=2.0)
    for i in range(2000):  # 10 events per second for 200 s
        acc.add(i * 0.1)
    assert acc(199.9) == pytest.approx(10.0, rel=0.06)


def test_amounts_in_seconds_read_as_a_busy_share() -> None:
    acc = DecayedRate(window_s=5.0)
    for i in range(500):  # 0.05 s of work every 0.1 s
        acc.add(i * 0.1, 0.05)
    assert acc(49.9) == pytest.approx(0.5, rel=0.06)


def test_it_decays_with_its_time_constant() -> None:
    acc = DecayedRate(window_s=4.0)
    acc.add(0.0, 4.0)
    assert acc(0.0) == pytest.approx(1.0)
    assert acc(4.0) == pytest.approx(math.exp(-1.0))
    assert acc(-1.0) == pytest.approx(1.0)  # a clock read out of order does not grow it


def test_warmed_scales_a_fresh_accumulator_to_the_time_seen() -> None:
    acc = DecayedRate(window_s=10.0)
    for i in range(11):  # 10 per second for the first second
        acc.add(i * 0.1)
    assert acc(1.0) < 2.0
    assert acc.warmed(1.0) == pytest.approx(11.0, rel=0.1)
    assert DecayedRate(1.0).warmed(5.0) == 0.0
    assert DecayedRate(1.0)(5.0) == 0.0


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window_s"):
        DecayedRate(0.0)
