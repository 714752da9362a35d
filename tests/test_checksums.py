"""A checkpoint whose every file has its right size but one byte changed inside (a bad sector, a copy
that flipped a bit) is refused by the check before a load, naming the file: each file's size and
CRC-32 are recorded when the checkpoint is committed (`tandem.checksums`). For the service's
checkpoints (`tandem.serve.checkpoints`, and through the SDK: the live model unchanged) and for
`tandem train`'s (the resume check; on a real run in test_damaged_checkpoints.py). A checkpoint
saved before checksums were recorded is checked as before."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tandem import checksums
from tandem.config import Config, save_config
from tandem.controller.checkpoint import Checkpoints as RunCheckpoints
from tandem.errors import TandemError
from tandem.model.config import resolve_model_path
from tandem.serve.checkpoints import Checkpoints as ServeCheckpoints
from tandem.train.state import SHARDS, dcp


def flip_a_byte(file: Path) -> None:
    """The middle byte inverted (inside a tensor's data, for the files here); the size kept."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def write_parts(tmp: Path) -> None:
    """What a trainer's save writes into a checkpoint's directory: the built-in model's Hugging Face
    files, and trainer/ (DCP shards of a state, rank_0.pt)."""
    for file in resolve_model_path("builtin:addition").iterdir():
        shutil.copy(file, tmp / file.name)
    state = {"weights": torch.arange(4096, dtype=torch.float32), "moments": torch.ones(4096)}
    dcp().save(state, checkpoint_id=str(tmp / SHARDS), no_dist=True)
    torch.save({"version": 1}, tmp / SHARDS / "rank_0.pt")


# ---------------------------------------------------------------- the record


def test_a_flipped_byte_a_cut_and_a_deleted_file_are_each_named_and_nothing_else(tmp_path):
    for name, data in {"a.bin": b"a" * 1000, "sub/b.bin": b"b" * 1000, "sub/c.bin": b"c" * 10}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    everything = lambda name: True  # noqa: E731
    assert checksums.damage(tmp_path, everything) == {}  # nothing recorded: nothing compared
    checksums.record(tmp_path)
    assert checksums.damage(tmp_path, everything) == {}
    flip_a_byte(tmp_path / "a.bin")
    (tmp_path / "sub" / "b.bin").write_bytes(b"b" * 999)
    (tmp_path / "sub" / "c.bin").unlink()
    (tmp_path / "sub" / "new.bin").write_bytes(b"not recorded: not compared")
    found = checksums.damage(tmp_path, everything)
    assert list(found.values()) == [
        f"{tmp_path / 'a.bin'} is corrupt (its CRC-32 is not the one recorded when it was written)",
        f"{tmp_path / 'sub' / 'b.bin'} is truncated (999 of 1000 bytes written)",
        f"{tmp_path / 'sub' / 'c.bin'} is missing",
    ]
    assert list(checksums.damage(tmp_path, lambda name: name.startswith("sub/"))) == [
        tmp_path / "sub" / "b.bin",
        tmp_path / "sub" / "c.bin",
    ]
    (tmp_path / checksums.RECORD).write_text("{not json")
    assert "checksums.json is unreadable" in " ".join(checksums.damage(tmp_path, everything).values())


# ---------------------------------------------------------------- the service's checkpoints

META = {"base_model": "builtin:addition", "rank": 8, "seed": 0, "attn": True, "mlp": True}


def service_checkpoint(root: Path) -> tuple[ServeCheckpoints, Path]:
    """A save_state checkpoint written as the service writes one -> its Checkpoints and directory."""
    checkpoints = ServeCheckpoints(root)
    _, where = checkpoints.place("session-1:train:0", "weights", "saved")
    with checkpoints.writing_to(where, META) as tmp:
        write_parts(tmp)
    return checkpoints, where


@pytest.mark.parametrize("file", ["trainer/__0_0.distcp", "model.safetensors", "serve.json"])
def test_a_service_checkpoint_with_a_flipped_byte_is_refused_naming_the_file(tmp_path, file):
    checkpoints, where = service_checkpoint(tmp_path)
    assert checkpoints.find(where) == META
    if file == "serve.json":  # still JSON, of another model: a flip no parse sees
        (where / file).write_text(json.dumps({**META, "rank": 9}))
    else:
        flip_a_byte(where / file)
    with pytest.raises(TandemError, match=rf"is damaged, so it was not loaded.*{file} is corrupt"):
        checkpoints.find(where)


def test_a_service_checkpoint_saved_before_checksums_loads_as_before(tmp_path):
    checkpoints, where = service_checkpoint(tmp_path)
    (where / checksums.RECORD).unlink()
    assert checkpoints.find(where) == META
    (where / SHARDS / "__0_0.distcp").write_bytes(b"cut")  # what the older checks saw, they still see
    with pytest.raises(TandemError, match=r"__0_0\.distcp is truncated"):
        checkpoints.find(where)


# ---------------------------------------------------------------- tandem train's checkpoints


def run_checkpoint(run_dir: Path) -> Path:
    """A checkpoint committed as `tandem train` commits one (`Checkpoints.commit`) -> its path."""
    checkpoints = RunCheckpoints(run_dir)
    tmp = checkpoints.begin("step_1")
    write_parts(tmp)
    torch.save({"version": 1}, tmp / "driver.pt")
    save_config(Config(), tmp / "config.yaml")
    return checkpoints.commit(tmp, "step_1")


@pytest.mark.parametrize("file", ["trainer/__0_0.distcp", "model.safetensors"])
def test_a_run_checkpoint_with_a_flipped_byte_is_refused_before_a_resume_naming_the_file(tmp_path, file):
    from tandem.runtime.resume import damage

    path = run_checkpoint(tmp_path)
    assert json.loads((path / checksums.RECORD).read_text())["files"].keys() >= {file, "driver.pt"}
    assert damage(path) == []
    flip_a_byte(path / file)
    found = damage(path)
    assert len(found) == 1 and f"{path / file} is corrupt" in found[0], found


def test_a_run_checkpoint_saved_before_checksums_is_checked_as_before(tmp_path):
    from tandem.runtime.resume import damage

    path = run_checkpoint(tmp_path)
    (path / checksums.RECORD).unlink()
    assert damage(path) == []


@pytest.mark.integration  # a service process of its own: seconds to start
def test_through_the_sdk_a_flipped_byte_is_refused_and_the_live_model_is_unchanged(tmp_path):
    """save_state, a step, a byte flipped inside the saved optimizer shard: load_state refuses it
    naming the shard, and the live model is the one before the load. Before checksums, the load
    took the changed number in silently."""
    tinker = pytest.importorskip("tinker")
    from test_serve_tinker import MODEL, WAIT_S, carries, client, logprobs, sft_step, start_service

    process, url = start_service(tmp_path)
    try:
        with client(url) as service:
            training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result()
            data = carries(training.get_tokenizer())
            path = training.save_state("to-flip").result(timeout=WAIT_S).path
            sft_step(training, data)
            before = logprobs(training, data)
            (shard,) = tmp_path.rglob("to-flip/trainer/__0_0.distcp")
            flip_a_byte(shard)
            for load in (training.load_state_with_optimizer, training.load_state):
                with pytest.raises(tinker.BadRequestError, match=r"damaged.*__0_0\.distcp is corrupt"):
                    load(path).result(timeout=WAIT_S)
            assert logprobs(training, data) == before
    finally:
        process.terminate()
        process.wait(30)
