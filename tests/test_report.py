"""`tandem report` renders a real run (and several overlaid) into one page of plots and PNGs; W&B
logs every metrics line (offline, no network)."""

import base64
import json
import shutil
import subprocess

import matplotlib.image
import pytest
from helpers import write_tiny_checkpoint
from test_cli import FAST as CLI_FAST

from tandem.cli.main import main
from tandem.controller.metrics import MetricsLogger

FAST = [*CLI_FAST, "run.val_every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs of 3 steps (sync, and one_step_off with a correction) on Ray."""
    root = tmp_path_factory.mktemp("runs")
    ckpt = write_tiny_checkpoint(root / "tiny")
    for name, extra in [("sync", []), ("offpolicy", ["run.mode=one_step_off", "algo.corrections=[tis]"])]:
        args = ["train", f"model.path={ckpt}", f"run.out_dir={root}", f"run.name={name}", "run.steps=3"]
        assert main([*args, *FAST, *extra]) == 0
    return root


def not_blank(png) -> bool:
    image = matplotlib.image.imread(png)
    return image.shape[0] > 200 and image.shape[1] > 500 and float(image[..., :3].std()) > 0.05


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_a_real_run_renders_every_plot_into_the_page_and_pngs(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", str(runs / "sync"), str(runs / "offpolicy"), "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    pngs = sorted((tmp_path / "report_png").glob("*.png"))
    names = {p.stem for p in pngs}
    assert {"reward_accuracy", "reward_accuracy_time", "staleness", "mismatch", "throughput", "lengths",
            "timeline", "corrections"} <= names  # fmt: skip
    assert all(not_blank(p) for p in pngs)
    page = out.read_text()
    for p in pngs:  # self-contained: every image embedded, byte for byte
        assert base64.b64encode(p.read_bytes()).decode() in page
    assert "<td>sync</td>" in page and "<td>offpolicy</td>" in page


def test_a_run_without_some_metrics_says_so_instead_of_plotting(tmp_path):
    run = tmp_path / "bare"
    run.mkdir()
    lines = [{"step": 0, "val/accuracy": 0.5}, {"step": 1, "version": 1, "critic/score/mean": 0.4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert page.count("No run has data for this plot.") == 6  # all but the two reward/accuracy plots
    assert {p.stem for p in (tmp_path / "r_png").glob("*.png")} == {"reward_accuracy", "reward_accuracy_time"}


def test_a_directory_that_is_not_a_run_is_one_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r.html")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no headless chromium here")
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_the_page_renders_in_a_headless_browser(runs, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(runs / "sync"), "--out", str(out)]) == 0
    shot = tmp_path / "shot.png"
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
    ]
    subprocess.run(["chromium", *flags, f"--screenshot={shot}", "--window-size=1400,2000", out.as_uri()],
                   check=True, timeout=120, capture_output=True)  # fmt: skip
    assert not_blank(shot)


@pytest.mark.integration  # seconds of CPU: out of the unit tier (< 2 minutes)
def test_wandb_offline_logs_every_metrics_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing outside tmp_path
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    options = dict(project="tandem-test", entity=None, name="t", mode="offline", config={"run": {"seed": 0}})
    log = MetricsLogger(tmp_path, 3, tensorboard=False, progress=False, wandb=options)
    for step in (1, 2, 3):
        log.log(step, {"critic/score/mean": step / 8, "mismatch/kl": 0.0})
    log.close()
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    data = files[0].read_bytes()
    assert b"critic/score/mean" in data and b"mismatch/kl" in data
    assert all(json.dumps(step / 8).encode() in data for step in (1, 2, 3))
    assert (tmp_path / "wandb_id").read_text() in files[0].name  # a resumed run continues this W&B run
