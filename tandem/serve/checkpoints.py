"""save_state's checkpoints on disk: named safely, written whole or not at all, checked before a load.

    <run.out_dir>/<run.name>/<model id, %-quoted>/weights/
        <name>/        serve.json (the model's base and LoRA shape), the Hugging Face weights and
                       adapter, trainer/ (DCP shards of the master weights and AdamW's moments,
                       rank_0.pt: schedule, RNGs, version), checksums.json (each file's size and
                       CRC-32 as written)
        .<name>.new/   a save being written
        .<name>.old/   the checkpoint an overwrite replaces, until the new one is in place
        .<name>.deleted/  a checkpoint being deleted
    .../external_weights/<name>/   save_weights_external's, laid out the same

A save writes `.<name>.new/`, records every file's size and CRC-32 in its checksums.json
(`tandem.checksums`), fsyncs every file, then renames it to `<name>`; an overwrite first
renames the old checkpoint to `.<name>.old/` and deletes it only once the new one is in. A crash
(a kill, a power cut) at any moment leaves the old checkpoint or the new one whole: `settle`, run
before every save and load of a name, finishes or undoes what the crash interrupted. A user's name
never starts with '.', so it never meets these. A load checks the checkpoint first (`damage`):
a file missing, cut short or with a byte changed since the save is named, and nothing is loaded.

What the REST side lists of a checkpoint (`tandem.serve.rest`): serve.json also holds when it was
saved, its expiry (ttl_seconds from the save) and the client's user_metadata; what changes later
(a new ttl, published) goes in rest.json beside it, which checksums.json does not cover. A checkpoint
past its expiry is deleted the next time anything looks at it (`exists`): a listing, a load, a save
of its name, the REST side's calls.
"""

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

from tandem import checksums
from tandem.errors import TandemError
from tandem.model.checkpoint import check_checkpoint
from tandem.paths import replace_dir
from tandem.train.state import damaged_state

NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
MAX_NAME = 128  # with ".new" and the parent's names, well inside a file system's 255 bytes a name
MODEL_ID = re.compile(r"[A-Za-z0-9._:-]{1,80}")  # the service makes "session-<hex>:train:<n>"
META = "serve.json"
SHAPE = ("base_model", "rank", "seed", "attn", "mlp")  # what serve.json holds
REST = "rest.json"  # what the REST side changed after the save: not checksummed, as it may change
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
MAX_TTL_S = 10 * 365 * 24 * 3600  # Tinker's ceiling, 10 years


def check_name(name: str, what: str = "Checkpoint name") -> str:
    """A name that is one plain directory name on any file system, or a TandemError saying why not."""
    if len(name) > MAX_NAME or not NAME.fullmatch(name):
        shown = repr(name) if len(name) <= 60 else f"{name[:40]!r}... ({len(name)} characters)"
        raise TandemError(
            f"{what} {shown} must be 1 to {MAX_NAME} characters, letters, digits, '.', '_' and '-', "
            "not starting with '.'."
        )
    return name


def split(path: str) -> tuple[str, str, str]:
    """tinker://<model_id>/<kind>/<name> -> (model_id, kind, name), each checked; a TandemError
    saying what a checkpoint path is otherwise."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KINDS:
        raise TandemError(
            f"{path[:200]!r} is not a checkpoint path: tinker://<model_id>/<kind>/<name>, kind one of "
            f"{', '.join(KINDS)}."
        )
    check_name(parts[2])
    check_model_id(parts[0])
    return parts[0], parts[1], parts[2]


def check_model_id(model_id: str) -> str:
    if not MODEL_ID.fullmatch(model_id):
        raise TandemError(f"Model id {model_id[:100]!r} is not one the service makes.")
    return model_id


def model_dir(root: Path, model_id: str) -> Path:
    """Where a model's checkpoints and its run record live under the service's root."""
    return root / quote(model_id, safe="")


def expiry(ttl_seconds: int | None) -> float | None:
    """When something saved now with `ttl_seconds` expires (seconds since the epoch); None: never.
    A TandemError for a ttl outside 1 s to 10 years (Tinker's floor is an hour; tandem takes less,
    for short experiments and tests)."""
    if ttl_seconds is None:
        return None
    if not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= MAX_TTL_S:
        raise TandemError(
            f"ttl_seconds={ttl_seconds} must be from 1 to {MAX_TTL_S} (10 years), or None for no expiry."
        )
    return time.time() + ttl_seconds


def expired(expires_at: float | None) -> bool:
    return expires_at is not None and time.time() >= expires_at


def stamp(ttl_seconds: int | None, user_metadata: dict | None) -> dict:
    """What serve.json records of a save for the REST side: when, until when, the client's metadata."""
    metadata = strings(user_metadata)
    return {"saved_at": time.time(), "expires_at": expiry(ttl_seconds), "user_metadata": metadata}


def strings(metadata: dict | None) -> dict[str, str]:
    """user_metadata as Tinker's types hold it, str -> str (create_model's may carry any JSON)."""
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}


class Checkpoints:
    """The checkpoints under `root` (run.out_dir/run.name), and the saves in flight."""

    def __init__(self, root: Path):
        self.root = root
        self.writing: set[Path] = set()  # a save in flight: its `.new` is not a crash's leftover

    def place(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        """tinker://<model_id>/<kind>/<name> and its directory; TandemError for a name or model id
        that is not one plain directory name."""
        check_name(name)
        check_model_id(model_id)
        return f"tinker://{model_id}/{kind}/{name}", model_dir(self.root, model_id) / kind / name

    def parse(self, path: str) -> Path:
        """A save_state path (tinker://<model_id>/weights/<name>) -> its directory."""
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] != "weights":
            raise TandemError(
                f"{path[:200]!r} is not a save_state path (tinker://<model_id>/weights/<name>)."
            )
        return self.place(parts[0], "weights", parts[2])[1]

    def exists(self, where: Path) -> bool:
        """Whether a checkpoint is at `where`, once what a crash left there is settled and one past
        its expiry deleted."""
        if where in self.writing:
            return where.is_dir()
        settle(where)
        if where.is_dir() and expired(self.meta(where).get("expires_at")):
            self.delete(where)
        return where.is_dir()

    def meta(self, where: Path) -> dict:
        """serve.json with rest.json's changes over it, unchecked ({} for what cannot be read)."""
        found: dict = {}
        for name in (META, REST):
            with contextlib.suppress(OSError, ValueError):
                found.update(json.loads((where / name).read_text()))
        return found

    def amend(self, where: Path, **changes) -> None:
        """Record `changes` (expires_at, public) in the checkpoint's rest.json, replaced whole."""
        with contextlib.suppress(OSError, ValueError):
            changes = {**json.loads((where / REST).read_text()), **changes}
        tmp = where / f".{REST}.new"
        tmp.write_text(json.dumps(changes))
        os.replace(tmp, where / REST)

    def delete(self, where: Path) -> None:
        """Remove the checkpoint at `where`, renamed aside first so that a crash midway leaves none
        rather than part of one. TandemError while a save writes it."""
        if where in self.writing:
            raise TandemError(
                f"The checkpoint {where.name!r} is being written by a save in flight; delete it once "
                "that save's result is in."
            )
        gone = aside(where, "deleted")
        shutil.rmtree(gone, ignore_errors=True)
        where.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)

    def names(self, model_id: str, kind: str) -> list[str]:
        """The names of `model_id`'s checkpoints of `kind` (expired ones deleted on the way)."""
        folder = model_dir(self.root, model_id) / kind
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if NAME.fullmatch(p.name) and self.exists(p))

    def model_ids(self) -> list[str]:
        """Every model id with a directory under the root (its run record, its checkpoints)."""
        if not self.root.is_dir():
            return []
        ids = [unquote(p.name) for p in self.root.iterdir() if p.is_dir()]
        return [i for i in ids if MODEL_ID.fullmatch(i) and ":" in i]  # not samplers/

    def find(self, where: Path) -> dict | None:
        """The checkpoint at `where`, checked -> its serve.json; None when none was saved there. A
        damaged one is a TandemError naming each damaged or missing file; nothing is loaded."""
        if not self.exists(where):
            return None
        if found := damage(where):
            raise TandemError(
                f"The checkpoint {where} is damaged, so it was not loaded and the model is unchanged: "
                f"{'; '.join(found)}."
            )
        return json.loads((where / META).read_text())

    @contextlib.contextmanager
    def writing_to(self, where: Path, meta: dict) -> Iterator[Path]:
        """A fresh directory beside `where` to write its checkpoint into; when the block ends
        without an error, serve.json (`meta`) and the checksums of every file join it, and it
        replaces `where` whole (`commit`).
        After an error it is removed and `where` is as it was."""
        settle(where)
        tmp = aside(where, "new")
        tmp.mkdir(parents=True)
        self.writing.add(where)
        try:
            yield tmp
            (tmp / META).write_text(json.dumps(meta))
            checksums.record(tmp)
            commit(tmp, where)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self.writing.discard(where)


def aside(where: Path, kind: str) -> Path:
    """`where`'s sibling for a save in flight ("new") or the checkpoint it replaces ("old")."""
    return where.with_name(f".{where.name}.{kind}")


def commit(tmp: Path, where: Path) -> None:
    """`tmp`, every file fsynced, renamed to `where`; a checkpoint there is set aside first and
    deleted once the new one is in (`replace_dir`). A crash between any two steps leaves `settle` a
    whole one."""
    replace_dir(tmp, where, aside(where, "old"))


def settle(where: Path) -> None:
    """Finish or undo what a crash interrupted at `where`. Killed between an overwrite's two
    renames (`where` gone, the old one aside), the new one goes in: it was whole before the old one
    moved. Any other leftover (a save cut short, an old one not yet deleted) is removed."""
    new, old = aside(where, "new"), aside(where, "old")
    if old.exists() and not where.exists():
        (new if new.exists() else old).rename(where)
    for leftover in (new, old, aside(where, "deleted")):
        shutil.rmtree(leftover, ignore_errors=True)


def damage(where: Path) -> list[str]:
    """What keeps the checkpoint at `where` from loading, one phrase per damaged or missing file;
    [] when whole. Read without loading any state, each file against the size and CRC-32 its
    checksums.json recorded (a save before checksums has none): serve.json, the trainer's DCP
    shards and rank_0.pt (`damaged_state`), and the Hugging Face weights and adapter against
    config.json (`check_checkpoint`)."""
    found = list(checksums.damage(where, lambda name: name == META).values())
    try:
        meta = json.loads((where / META).read_text())
        if missing := [k for k in SHAPE if k not in meta]:
            found.append(f"{where / META} lacks {missing}")
    except (OSError, ValueError, TypeError) as e:
        if not found:  # a serve.json changed since the save is named once
            found.append(f"{where / META} is unreadable ({e})")
    found += damaged_state(where)
    try:
        check_checkpoint(where, finite=False)
    except Exception as e:  # a truncated or foreign file: the readers raise anything
        found.append(str(e).rstrip("."))
    return found
