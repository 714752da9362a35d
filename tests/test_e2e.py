"""End to end: the default `tandem train` raises held-out accuracy by at least 30 points (slow)."""

import json

import pytest

from tandem.cli.main import main


@pytest.mark.slow
def test_default_train_learns(tmp_path, capsys):
    assert main(["train", f"run.out_dir={tmp_path}", "run.progress=false"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    assert summary["val/accuracy_gain_points"] >= 30, summary
    records = [json.loads(line) for line in (tmp_path / "default" / "metrics.jsonl").read_text().splitlines()]
    first, last = records[1]["critic/score/mean"], records[-1]["critic/score/mean"]
    assert last > first + 0.2, (first, last)
    assert "held-out accuracy" in capsys.readouterr().out
