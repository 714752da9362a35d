"""Recorded samples (record_stability_info) are kept as Tinker keeps them: by session, a day after
sampling or after their last use in a training request, a bounded number in all."""

import pytest

pytest.importorskip("tinker")

from tandem.serve.losses import Recorded  # noqa: E402
from tandem.serve.records import Records  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def record(n: int) -> Recorded:
    return Recorded([1, 2], [n], [-0.5])


def test_a_record_lasts_a_day_from_its_last_use_and_belongs_to_its_session():
    clock = Clock()
    records = Records(keep_s=100.0, clock=clock)
    records.add("a", "req-1:0", record(1))
    records.add("a", "req-1:1", record(2))
    assert "req-1:0" not in records.of("b")  # another session's
    clock.now = 90.0
    assert records.of("a")["req-1:0"].tokens == [1]  # used: its day starts again
    clock.now = 150.0
    assert sorted(records.of("a")) == ["req-1:0"]  # the unused one expired at 100 s (listing uses none)
    clock.now = 191.0
    assert "req-1:0" not in records.of("a")


def test_at_most_so_many_are_kept_the_oldest_going_first():
    records = Records(most=3, clock=Clock())
    for i in range(5):
        records.add("a", f"req-{i}:0", record(i))
    assert sorted(records.of("a")) == ["req-2:0", "req-3:0", "req-4:0"]
