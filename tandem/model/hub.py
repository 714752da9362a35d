"""Hugging Face hub ids as model paths: `model.path=Qwen/Qwen2.5-0.5B-Instruct`, or
`ORG/NAME@REVISION` for a branch, tag or commit, fetched by huggingface_hub's `snapshot_download`
into its cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) and read from there
afterwards; with HF_HUB_OFFLINE=1, read from there only.

The revision rides in the spec rather than in a key of its own because a model is named by one
string in several places (model.path, model.tokenizer, algo.distill.teacher, reward.judge.path,
critic.path): one syntax serves them all, and `@` is how huggingface_hub's own
`hf://ORG/NAME@REVISION` paths spell it. Start-up (`tandem.runtime.startup.resolve_inputs`) turns
each into its snapshot's directory once; the run's config.yaml records that directory, so a resume
compares the commit it trained on.

`tandem.model.config.resolve_model_path` is the one caller. huggingface_hub is imported when a hub id
is resolved, not here: the simulator reads model shapes and loads no hub client.
"""

import functools
import re
from pathlib import Path

from tandem.errors import TandemError

# ORG/NAME[@REVISION]; the revision may hold slashes (refs/pr/1). huggingface_hub checks the rest.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>\S+))?")
# What tandem reads of a checkpoint: config.json, the safetensors weights and their index, the
# tokenizer (tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, tokenizer.model,
# chat_template.jinja, ...), a PEFT adapter (adapter_config.json, adapter_model.safetensors). Top
# level only: subfolders hold other formats' copies of the weights (onnx/, original/, gguf/).
ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
IGNORE = ["*/*"]


def hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo, revision or None) when `spec` reads as a hub id: ORG/NAME[@REVISION], not "builtin:",
    and no file or directory of that name here (a local path always wins). None otherwise."""
    found = HUB_ID.fullmatch(spec)
    if found is None or Path(spec).exists():
        return None
    return found["repo"], found["revision"]


def model_name(path: str) -> str:
    """The name a model directory goes by (an agent's requests name it): ORG/NAME for a hub
    snapshot (.../models--ORG--NAME/snapshots/<commit>), else the directory's own name."""
    where = Path(path)
    if where.parent.name == "snapshots" and where.parent.parent.name.startswith("models--"):
        return where.parent.parent.name.removeprefix("models--").replace("--", "/")
    return where.name or "tandem"


def snapshot(repo: str, revision: str | None, spec: str, key: str = "") -> Path:
    """The directory of `repo` at `revision` (None: the default branch) in the hub cache, downloaded
    first unless HF_HUB_OFFLINE is set; `spec` (the config's `key`) is what the user wrote. A
    TandemError of one paragraph for every way the hub or the cache says no."""
    from huggingface_hub import constants, errors

    try:
        return _download(repo, revision, constants.HF_HUB_CACHE, bool(constants.HF_HUB_OFFLINE))
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, errors.HFValidationError) as e:
        raise TandemError(_explain(e, repo, revision, spec, key)) from None


@functools.cache
def _download(repo: str, revision: str | None, cache: str, offline: bool) -> Path:
    """Once a process per (repo, revision, cache, offline): the driver's checks and the model it
    loads then read the same commit, and an online run asks the hub once, not at every call site.
    `cache` and `offline` are huggingface_hub's settings, in the key so that a change is seen."""
    from huggingface_hub import snapshot_download

    path = snapshot_download(
        repo, revision=revision, cache_dir=cache, allow_patterns=ALLOW, ignore_patterns=IGNORE
    )
    return Path(path)


def _explain(e: Exception, repo: str, revision: str | None, spec: str, key: str) -> str:
    """The paragraph for huggingface_hub's error `e` (the subclasses first: a gated repository's
    error is a RepositoryNotFoundError, an incomplete snapshot's a LocalEntryNotFoundError)."""
    from huggingface_hub import constants, errors

    named = f"{key}={spec}" if key else spec
    local = f"{named} is not a local directory ({Path(spec).absolute()} does not exist), so it was read"
    at = f" at revision {revision!r}" if revision else ""
    fetch = _fetch(repo, revision, key)
    cause = " ".join(str(e).split())  # the hub's messages run over several lines
    if isinstance(e, errors.GatedRepoError):
        return (
            f"{named}: {repo} is a gated model on the Hugging Face hub. Accept its licence at "
            f"https://huggingface.co/{repo} with your account, log in here (`hf auth login`, or set "
            f"HF_TOKEN) and run again; {fetch[0].lower()}{fetch[1:]}"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return (
            f"{local} as a Hugging Face hub id, and the hub has no model {repo} (or it is private: log "
            f"in with `hf auth login` or set HF_TOKEN). Check the spelling. {fetch}"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return (
            f"{named}: the Hugging Face hub model {repo} has no revision {revision or 'main'!r} (a branch, "
            f"tag or commit hash; see https://huggingface.co/{repo}/tree/main). Leave out @REVISION for "
            "the default branch, or name one that exists."
        )
    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # not in every huggingface_hub>=1.31
    if isinstance(e, incomplete):
        return f"{named}: the cached snapshot of {repo}{at} is missing files ({cause}). {fetch}"
    if isinstance(e, errors.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set, so nothing is downloaded"
        if not constants.HF_HUB_OFFLINE:  # the network error itself, not the hub's advice around it
            reason = e.__cause__ or e
            why = f"the hub could not be reached ({type(reason).__name__}: {' '.join(str(reason).split())})"
        return (
            f"{local} as a Hugging Face hub id: {repo}{at} is not in the hub cache "
            f"{constants.HF_HUB_CACHE} (HF_HUB_CACHE, or HF_HOME/hub) and {why}. {fetch}"
        )
    return f"{local} as a Hugging Face hub id, which huggingface_hub refused: {cause}"


def _fetch(repo: str, revision: str | None, key: str) -> str:
    """How to get `repo` into the cache, or do without it."""
    flag = f" --revision {revision}" if revision else ""
    instead = f"point {key} at a local checkpoint directory" if key else "give a local checkpoint directory"
    return (
        f"Fetch it on a machine with network (`hf download {repo}{flag}`, or `huggingface-cli download "
        f"{repo}{flag}` with an older huggingface_hub) into the cache this machine reads, or {instead}."
    )
