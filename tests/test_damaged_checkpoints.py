"""Nothing hangs, nothing lies: weights with NaN or inf, damaged checkpoints (a file gone, cut
short, or a byte flipped inside it, which only the checksums recorded at the save see:
test_checksums.py), a resume with fewer run.steps than the checkpoint has, and two runs in one
directory are each refused in one paragraph (exit 2) before anything starts; run.resume=auto falls
back to the newest intact checkpoint."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, nothing_may_start
from safetensors.torch import load_file, save_file

from tandem.cli.main import main
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model
from tandem.model.config import resolve_model_path
from tandem.runtime.run import run_training
from tandem.runtime.startup import load_config


class RayStarted(Exception):
    pass


def no_ray(monkeypatch) -> None:
    """Everything refused here is refused before Ray or the workers start: starting raises RayStarted."""
    nothing_may_start(monkeypatch, RayStarted())


def poisoned(tmp_path: Path, value: float) -> Path:
    """The built-in model with one weight element set to `value`."""
    path = tmp_path / "poisoned"
    shutil.copytree(resolve_model_path("builtin:addition"), path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_weights_with_nan_are_refused_at_load_naming_the_file_and_the_tensor(tmp_path):
    path = poisoned(tmp_path, float("nan"))
    with pytest.raises(TandemError, match=r"poisoned/model.safetensors .*model.layers.1.mlp.up_proj.weight"):
        load_model(path)


def test_train_refuses_a_model_with_inf_before_anything_starts(tmp_path, monkeypatch, capsys):
    no_ray(monkeypatch)
    path = poisoned(tmp_path, float("inf"))
    assert main(["train", *TINY, f"model.path={path}", f"run.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "model.layers.1.mlp.up_proj.weight (1 inf)" in err, err


# ---------------------------------------------------------------- damaged checkpoints

RUN = [*TINY, "run.val_every=0", "run.save_every=1", "run.steps=2"]


@pytest.fixture(scope="module")
def trained(ray_local, tmp_path_factory) -> Path:
    """A run of 2 steps with a checkpoint after each: step_1, step_2 and final (at step 2)."""
    out = tmp_path_factory.mktemp("trained")
    run_training(load_config(None, [*RUN, f"run.out_dir={out}"]))
    return out / "default"


def copy_run(run_dir: Path, to: Path) -> Path:
    """A copy of the run directory: its checkpoints as hard links (a checkpoint's files are never
    written again in place; the damage below replaces files), the rest as files of its own."""
    to.mkdir(parents=True)
    for p in run_dir.iterdir():
        if p.is_dir():
            shutil.copytree(p, to / p.name, copy_function=os.link)
        else:
            shutil.copy2(p, to / p.name)
    return to


def replace(file: Path, data: bytes) -> None:
    file.unlink()  # a new file: the hard-linked original stays intact
    file.write_bytes(data)


def truncate(file: Path) -> None:
    replace(file, file.read_bytes()[: file.stat().st_size // 2])


def flip_a_byte(file: Path, at: int = 200) -> None:
    """Byte `at` (the middle of the file when negative) inverted; the file keeps its size."""
    data = bytearray(file.read_bytes())
    data[at if at >= 0 else len(data) // 2] ^= 0xFF  # 200: inside the first record of a torch.save zip
    replace(file, bytes(data))


DAMAGE = {  # what is done to a checkpoint -> the file the refusal must name
    "optimizer shards gone": (lambda c: (c / "trainer" / "__0_0.distcp").unlink(), "trainer/__0_0.distcp"),
    "optimizer shards truncated": (lambda c: truncate(c / "trainer" / "__0_0.distcp"), "__0_0.distcp"),
    "DCP metadata gone": (lambda c: (c / "trainer" / ".metadata").unlink(), "trainer/.metadata"),
    "rank state gone": (lambda c: (c / "trainer" / "rank_0.pt").unlink(), "trainer/rank_0.pt"),
    "driver state truncated": (lambda c: truncate(c / "driver.pt"), "driver.pt"),
    "driver state corrupt": (lambda c: flip_a_byte(c / "driver.pt"), "driver.pt"),
    "weights truncated": (lambda c: truncate(c / "model.safetensors"), "model.safetensors"),
    # the right sizes, one byte inside a tensor changed: only the checksums recorded at the save see it
    "optimizer shard flipped": (lambda c: flip_a_byte(c / "trainer" / "__0_0.distcp", -1), "__0_0.distcp"),
    "weights flipped": (lambda c: flip_a_byte(c / "model.safetensors", -1), "model.safetensors"),
}


@pytest.mark.ray  # every test of `trained`: the fixture's run starts Ray
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_resuming_an_explicit_damaged_checkpoint_names_the_file_before_anything_starts(
    damage, trained, tmp_path, monkeypatch, capsys
):
    no_ray(monkeypatch)
    run_dir = copy_run(trained, tmp_path / "default")
    checkpoint = run_dir / "checkpoints" / "step_1"
    harm, named = DAMAGE[damage]
    harm(checkpoint)
    code = main(["train", *RUN, f"run.out_dir={tmp_path}", f"run.resume={checkpoint}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert f"{checkpoint}" in err and named in err, err


@pytest.mark.ray
def test_resume_auto_falls_back_to_the_newest_intact_checkpoint_and_deletes_nothing(
    trained, tmp_path, capsys
):
    run_dir = copy_run(trained, tmp_path / "default")
    checkpoints = run_dir / "checkpoints"
    truncate(checkpoints / "final" / "driver.pt")  # `latest` names final
    (checkpoints / "step_2" / "trainer" / "__0_0.distcp").unlink()
    summary = run_training(load_config(None, [*RUN, f"run.out_dir={tmp_path}", "run.resume=auto"]))
    lines = capsys.readouterr().err.strip().splitlines()
    said = [line for line in lines if line.startswith("run.resume=auto")]
    assert len(said) == 1 and "skipped final (driver.pt" in said[0] and "step_2 (trainer/" in said[0], lines
    assert said[0].endswith(f"continuing from {checkpoints / 'step_1'}."), said[0]
    records = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "version" in r] == [1, 2]  # step 2 trained again, once
    assert summary["reward/failed_fraction"] == 0.0
    assert sorted(p.name for p in checkpoints.iterdir()) == ["final", "latest", "step_1", "step_2"]


@pytest.mark.ray
def test_resume_auto_with_no_intact_checkpoint_refuses_listing_the_damage(
    trained, tmp_path, monkeypatch, capsys
):
    no_ray(monkeypatch)
    run_dir = copy_run(trained, tmp_path / "default")
    names = ["final", "step_1", "step_2"]
    for name in names:
        truncate(run_dir / "checkpoints" / name / "driver.pt")
    assert main(["train", *RUN, f"run.out_dir={tmp_path}", "run.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert all(f"{name}/driver.pt" in err for name in names), err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(["latest", *names])


@pytest.mark.ray
def test_resuming_with_fewer_steps_than_the_checkpoint_says_so(trained, tmp_path, monkeypatch, capsys):
    no_ray(monkeypatch)
    copy_run(trained, tmp_path / "default")
    assert main(["train", *RUN, "run.steps=1", f"run.out_dir={tmp_path}", "run.resume=auto"]) == 2
    err = capsys.readouterr().err
    assert "is at step 2" in err and "run.steps=1" in err and "raise run.steps above 2" in err, err


# ---------------------------------------------------------------- one run per directory

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_second_run_on_a_locked_directory_is_refused_and_a_killed_holder_blocks_nothing(
    tmp_path, monkeypatch
):
    no_ray(monkeypatch)
    run_dir = tmp_path / "default"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir / "run.lock")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        cfg = load_config(None, [*TINY, f"run.out_dir={tmp_path}"])
        with pytest.raises(TandemError, match=rf"{run_dir}.*pid {holder.pid}"):
            run_training(cfg)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with pytest.raises(RayStarted):  # the OS released the dead holder's lock
        run_training(cfg)
    with pytest.raises(RayStarted):  # and the refused or failed runs released theirs
        run_training(cfg)


@pytest.mark.parametrize("renamed", [False, True], ids=["before the second rename", "after it"])
def test_a_crash_within_an_overwrite_leaves_the_old_or_the_new_checkpoint(tmp_path, renamed):
    """`Checkpoints.commit` overwrites by renaming the old checkpoint aside, then the new one in. A
    crash between the two used to leave neither: `clear_partial` deleted both at the next start."""
    from tandem.controller.checkpoint import TMP, Checkpoints

    checkpoints = Checkpoints(tmp_path)
    for content in ("old", "new"):
        tmp = checkpoints.begin("final")
        (tmp / "weights").write_text(content)
        if content == "old":
            checkpoints.commit(tmp, "final")
    root = checkpoints.root
    (root / "final").rename(root / f"{TMP}old-final")  # the commit's first rename, then the crash
    if renamed:
        (root / f"{TMP}final").rename(root / "final")
    checkpoints.clear_partial()
    assert (root / "final" / "weights").read_text() == ("new" if renamed else "old")
    assert not list(root.glob(f"{TMP}*"))
