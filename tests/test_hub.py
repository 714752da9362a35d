"""model.path as a Hugging Face hub id (ORG/NAME[@REVISION]): resolved through huggingface_hub's
cache with no network (HF_HUB_OFFLINE=1, a cache laid out on disk from the shipped toy model), and
every way the hub or the cache says no is one paragraph naming the id and what to do."""

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from huggingface_hub import constants, errors, scan_cache_dir
from test_cli import FAST, run_cli

from tandem.errors import TandemError
from tandem.model import hub
from tandem.model.checkpoint import load_model
from tandem.model.config import model_dir, resolve_model_path

REPO = "tandem-test/addition"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo: str, source: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """`source`'s files in huggingface_hub's cache layout, as `hf download` leaves them: each file a
    blob named by its hash, linked from snapshots/<commit>/, and refs/<ref> holding the commit."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A hub cache holding builtin:addition as tandem-test/addition (main and the tag v1)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    cache_repo(cache, REPO, resolve_model_path("builtin:addition"), COMMIT, ("main", "v1"))
    return cache


@pytest.fixture
def offline(cache, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=`cache`, for this process (huggingface_hub read the
    environment when it was imported) and for any it starts."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(cache):
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO and repo.refs["main"].commit_hash == COMMIT
    files = {f.file_name for f in repo.refs["v1"].files}
    assert files >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_a_hub_id_resolves_to_its_cached_snapshot_and_loads(offline):
    snapshot = offline / "models--tandem-test--addition" / "snapshots" / COMMIT
    assert resolve_model_path(REPO) == snapshot
    assert model_dir(REPO) == snapshot
    for revision in ("main", "v1", COMMIT):  # a branch, a tag, a commit
        assert resolve_model_path(f"{REPO}@{revision}") == snapshot
    loaded = load_model(snapshot).state_dict()
    shipped = load_model(resolve_model_path("builtin:addition")).state_dict()
    assert loaded.keys() == shipped.keys()
    assert all(torch.equal(loaded[name], shipped[name]) for name in loaded)


def test_a_local_path_wins_over_a_hub_id_of_the_same_name(offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(resolve_model_path("builtin:addition"), tmp_path / REPO)
    assert hub.hub_id(REPO) is None and resolve_model_path(REPO) == Path(REPO)
    assert hub.hub_id("builtin:addition") is None and hub.hub_id("/abs/org/name") is None
    assert hub.hub_id("./org/name") is None and hub.hub_id("a/b/c") is None
    assert hub.hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")


def test_tandem_train_on_a_hub_id_reads_the_offline_cache(offline, tmp_path, capsys):
    args = ["train", f"model.path={REPO}", "run.steps=1", "run.cluster=local", f"run.out_dir={tmp_path}"]
    code, out, err = run_cli([*args, *FAST], capsys)
    assert code == 0, err
    run = tmp_path / "default"
    # Resolved once at start-up: the run records the snapshot it trained on, in the offline cache.
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]["path"]
    assert Path(saved) == resolve_model_path(REPO).resolve() and "models--" in saved
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("step") == 1 and "actor/pg_loss" in r for r in steps)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_an_id_missing_offline_is_one_paragraph_naming_it_and_fetching(command, offline, tmp_path, capsys):
    spec = "nobody/no-such-model"
    args = ["train", f"model.path={spec}"] if command == "train" else ["eval", "--model", spec]
    code, _, err = run_cli([*args, f"run.out_dir={tmp_path}"], capsys)
    assert code == 2
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    for said in (
        f"{spec} is not a local directory",  # the path reading
        "read as a Hugging Face hub id",  # the hub reading
        f"`hf download {spec}`",
        f"`huggingface-cli download {spec}`",
        "HF_HUB_OFFLINE",
        str(offline),  # the cache it looked in
    ):
        assert said in err, (said, err)


def test_a_revision_not_cached_is_named_with_how_to_fetch_it(offline):
    with pytest.raises(TandemError) as e:
        model_dir(f"{REPO}@v2", "algo.distill.teacher")
    message = str(e.value)
    assert "\n" not in message
    for said in (
        f"algo.distill.teacher={REPO}@v2",
        "at revision 'v2'",
        str(offline),
        f"`hf download {REPO} --revision v2`",
        "point algo.distill.teacher at a local checkpoint directory",
    ):
        assert said in message, (said, message)


def http(kind: type[Exception]) -> Callable[[], Exception]:
    """`kind` as huggingface_hub raises it after an HTTP answer (its message over two lines)."""
    answer = SimpleNamespace(headers={}, request=None)
    return lambda: kind("404 Client Error.\n\nRepository Not Found", response=answer)


def unreachable() -> Exception:
    """What snapshot_download raises when the network is down and the cache lacks the model."""
    error = errors.LocalEntryNotFoundError("An error happened...\nPlease check your internet connection.")
    error.__cause__ = ConnectionError("[Errno -2] Name or service not known")
    return error


def incomplete() -> Exception:
    missing = "The cached snapshot for 'org/name' is incomplete: 1 file(s) are missing (model.safetensors)."
    return errors.IncompleteSnapshotError(missing, snapshot_path="/cache/snapshots/x")


@pytest.mark.parametrize(
    "error, expected",
    [
        (http(errors.RepositoryNotFoundError), r"the hub has no model org/name .*`hf download org/name`"),
        (http(errors.GatedRepoError), r"org/name is a gated model.*Accept its licence.*hf auth login"),
        (http(errors.RevisionNotFoundError), r"org/name has no revision 'main'.*Leave out @REVISION"),
        (http(errors.HfHubHTTPError), r"huggingface_hub refused: 404 Client Error. Repository Not Found"),
        (unreachable, r"could not be reached \(ConnectionError: \[Errno -2\] Name or service not known\)"),
        pytest.param(
            incomplete,
            r"cached snapshot of org/name is missing files \(.*model.safetensors\).*`hf download org/name`",
            marks=pytest.mark.skipif(
                not hasattr(errors, "IncompleteSnapshotError"), reason="not in this huggingface_hub"
            ),
        ),
    ],
    ids=["not found", "gated", "no revision", "other HTTP", "no connection", "incomplete"],
)
def test_each_hub_error_is_one_paragraph(error, expected, monkeypatch):
    def refuse(*args, **kwargs):
        raise error()

    monkeypatch.setattr("huggingface_hub.snapshot_download", refuse)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(TandemError, match=expected) as e:
        hub.snapshot("org/name", None, "org/name", "model.path")
    assert "\n" not in str(e.value)


def test_an_id_huggingface_hub_refuses_to_read_is_one_paragraph(offline):
    refused = r"org/bad--name is not a local directory .*huggingface_hub refused: Cannot have --"
    with pytest.raises(TandemError, match=refused):
        resolve_model_path("org/bad--name")
