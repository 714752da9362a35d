"""The timeline: idle ratios from spans, and a Chrome trace Perfetto can open."""

import json

import pytest

from tandem.controller.timeline import Span, Timeline


def test_idle_ratio_counts_overlapping_spans_once_and_clips_to_the_window():
    t = Timeline({"rollout": ["rollout/0", "rollout/1"], "train": ["train/0"]})
    t.add(
        Span("generate", "rollout/0", 0.0, 6.0),
        Span("val", "rollout/0", 4.0, 8.0),  # overlaps: busy 0..8
        Span("generate", "rollout/1", 9.0, 12.0),  # clipped to 9..10
        Span("train", "train/0", 2.0, 4.0),
    )
    ratios = t.idle_ratios(0.0, 10.0)
    assert ratios["perf/idle_ratio/rollout"] == pytest.approx(1 - (8 + 1) / 20)
    assert ratios["perf/idle_ratio/train"] == pytest.approx(0.8)


def test_trace_is_chrome_format_with_one_track_per_worker(tmp_path):
    t = Timeline({"rollout": ["rollout/0"], "train": ["train/0"]})
    t.add(
        Span("generate", "rollout/0", t.start + 1, t.start + 2),
        Span("train", "train/0", t.start + 2, t.start + 3),
    )
    t.write(tmp_path / "timeline.json")
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in spans] == [("generate", 1e6, 1e6), ("train", 2e6, 1e6)]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"rollout", "train", "rollout/0", "train/0"}
    assert spans[0]["pid"] != spans[1]["pid"]
