"""Which checkpoint `run.resume` continues from, checked before anything starts: the one it names,
or the newest intact one of the run, each file checked without loading any state (docs/resume.md).
"""

import sys
from dataclasses import asdict
from pathlib import Path

from tandem.config import Config
from tandem.controller.checkpoint import TMP, Checkpoints
from tandem.errors import TandemError
from tandem.model.checkpoint import check_checkpoint
from tandem.model.config import resolve_model_path
from tandem.runtime.placement import role_counts
from tandem.runtime.startup import MODEL_PATHS, load_config
from tandem.train.state import CRITIC, SHARDS, damaged_state, saved_version, torch_file_damage

# Keys a resumed run must share with the checkpoint: they decide which prompts form which group,
# which weights and optimizer the state belongs to, and the staleness bound the buffer held.
FIXED = [
    "model.path",
    "model.tokenizer",
    "data.task",
    "data.task_config",
    "data.train_files",
    "data.train_size",
    "data.prompt_key",
    "data.max_prompt_length",
    "data.shuffle",
    "run.seed",
    "run.mode",
    "run.generate_ahead_steps",
    "run.max_staleness",
    "rollout.batch_size",
    "rollout.n",
    "rollout.num_workers",
    "rollout.engine",
    "train.num_workers",
    "train.strategy",
    "train.offload",
    "train.lora",  # which tensors train, so which the saved state holds
    "algo.adv_estimator",  # gae's critic has its own state in the checkpoint; the others have none
]


def find_resume(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint `run.resume` names, checked before anything starts: "auto" = the newest intact
    one of this run (None when the run has none yet: it starts fresh), a path = that checkpoint,
    "" = None. TandemError when its config changed a FIXED key (`check_compatible`), when the path's
    checkpoint is damaged (`damage`), when no checkpoint of the run is intact, or when the
    checkpoint already holds run.steps steps."""
    resume = cfg.run.resume
    if not resume:
        return None
    if resume == "auto":
        path = newest_intact(Checkpoints(run_dir), cfg)
    else:
        path = Path(resume)
        if found := damage(path, cfg):
            raise TandemError(
                f"run.resume={resume!r} cannot be resumed from: {'; '.join(found)}. Nothing was changed "
                "or deleted. Restore the files, or resume from another checkpoint (run.resume=auto "
                f"takes the newest intact one of {run_dir / 'checkpoints'})."
            )
    if path is not None and (version := saved_version(path)) >= cfg.run.steps:
        raise TandemError(
            f"The checkpoint {path} is at step {version}, and run.steps={cfg.run.steps} counts from the "
            "start of the run, so nothing is left to train. To train on from it, raise run.steps "
            f"above {version}; to train from the start, give the run another run.name."
        )
    return path


def newest_intact(checkpoints: Checkpoints, cfg: Config) -> Path | None:
    """The newest checkpoint without damage, saying in one line which newer ones it skipped and why.
    None when there is no checkpoint at all. When every one is damaged, a TandemError rather than a
    fresh start: that would lose the work they hold and, step by step, write over them."""
    skipped = []
    for path in newest_first(checkpoints):
        if not (found := damage(path, cfg)):
            if skipped:
                reasons = ", ".join(f"{p.name} ({'; '.join(f)})".replace(f"{p}/", "") for p, f in skipped)
                print(f"run.resume=auto: skipped {reasons}; continuing from {path}.", file=sys.stderr)
            return path
        skipped.append((path, found))
    if not skipped:
        return None
    listed = "; ".join(problem for _, found in skipped for problem in found)
    raise TandemError(
        f"run.resume=auto found no intact checkpoint in {checkpoints.root}: {listed}. Nothing was "
        "changed or deleted. Restore the files or point run.resume at a checkpoint; to start afresh "
        "instead, give the run another run.name."
    )


def damage(path: Path, cfg: Config | None = None) -> list[str]:
    """What keeps the checkpoint at `path` from being resumed, one phrase per damaged or missing file;
    [] when it is intact. Every file a resume reads is checked without loading any state:
    config.yaml parses, driver.pt and each train rank's rank_<r>.pt are whole torch.save archives
    (their records' checksums match), the DCP shards of trainer/ (and critic/ under
    algo.adv_estimator=gae) are all there at full length, and the Hugging Face weights match
    config.json and hold no NaN or inf (`check_checkpoint`). Each of those files is first compared
    with the size and CRC-32 its checkpoint's checksums.json recorded (`tandem.checksums`; a
    checkpoint written before that has none and is checked as before), so a flipped byte inside a
    shard or the weights shows. With `cfg`, a saved config that differs in a FIXED key is
    refused first (`check_compatible` raises): that is the user's to set back, not damage."""
    if not path.is_dir():
        return [f"{path} is not a directory"]
    found = []
    config = path / "config.yaml"
    ranks = {"train": 1, "critic": 1 if (path / CRITIC).exists() else 0}  # unless the config says
    if not config.is_file():
        found.append(f"{config} is missing")
    else:
        try:
            saved = load_config(config)
        except TandemError as e:
            found.append(f"{config} is unreadable ({e})")
        else:
            if cfg is not None:
                check_compatible(saved, cfg, path)
            ranks = role_counts(saved)
    if problem := torch_file_damage(path / "driver.pt"):
        found.append(problem)
    found += damaged_state(path, SHARDS, ranks["train"])
    if ranks["critic"]:
        found += damaged_state(path, CRITIC, ranks["critic"])
    try:
        check_checkpoint(path)
    except TandemError as e:
        found.append(str(e).rstrip("."))
    return found


def check_compatible(saved: Config, cfg: Config, path: Path) -> None:
    """Refuse a resume whose config changed a key the saved state depends on (FIXED)."""
    old, new = _flat(saved), _flat(cfg)
    changed = [k for k in FIXED if old.get(k) != new.get(k) and not same_model(k, old.get(k), new.get(k))]
    if changed:
        diffs = "; ".join(f"{k}: {old.get(k)!r} in the checkpoint, {new.get(k)!r} now" for k in changed)
        raise TandemError(
            f"Cannot resume from {path}: {diffs}. The saved buffer, data cursor and optimizer state "
            "belong to the checkpoint's values of these keys. Set them back (the checkpoint's "
            f"config is {path / 'config.yaml'}), or start a new run (another run.name, or "
            "run.resume unset). Changing other keys, such as run.steps or logging, is allowed."
        )


def same_model(key: str, saved: object, now: object) -> bool:
    """Whether a model path saved as the user wrote it ("builtin:addition", ORG/NAME: a checkpoint
    of a tandem before start-up recorded the directory) names the directory the run has now."""
    if key not in MODEL_PATHS or not (isinstance(saved, str) and isinstance(now, str) and saved and now):
        return False
    try:
        return resolve_model_path(saved, key).resolve() == Path(now).resolve()
    except TandemError:  # the saved name no longer resolves (offline, not cached): not the same
        return False


def _flat(cfg: Config) -> dict[str, object]:
    return {f"{section}.{key}": value for section, keys in asdict(cfg).items() for key, value in keys.items()}


def _step(path: Path) -> int:
    """The step a checkpoint was saved at: step_N's N, final's from its rank 0 state; -1 unknown."""
    if path.name.startswith("step_") and path.name[5:].isdigit():
        return int(path.name[5:])
    if torch_file_damage(path / SHARDS / "rank_0.pt") is None:
        return saved_version(path)
    return -1


def newest_first(checkpoints: Checkpoints) -> list[Path]:
    """Every checkpoint directory of the run: the one `latest` names, then the others by the step
    they were saved at, newest first (final's step is read from it when it can be)."""
    if not checkpoints.root.is_dir():
        return []
    saved = [p for p in checkpoints.root.iterdir() if p.is_dir() and not p.name.startswith(TMP)]
    latest = checkpoints.latest()
    return sorted(saved, key=lambda p: (p != latest, -_step(p)))
