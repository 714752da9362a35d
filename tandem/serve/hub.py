"""The served model's tokenizer for a client on another machine: the tokenizer's files served as a
Hugging Face hub repository, so that `transformers.AutoTokenizer.from_pretrained(repo_id)` (what the
SDK's `get_tokenizer` calls) loads them from the service, with no other network.

The SDK loads the tokenizer get_info names (`tokenizer_id`). For a client on this machine (it
reaches the service over loopback) that is the tokenizer's directory; for any other it is the
repository id the service serves the tokenizer as (`hub_repo`): the base model's own Hugging Face
id when it is one, else `tandem-serve/<its name>`. That client points huggingface_hub at the
service before it imports it: HF_ENDPOINT=http://<host>:<port>/api/v1/hf (and HF_TOKEN=<the API
key> when the service has one). `SamplingClient.get_tokenizer` asks for the base model's name up to
its first ':' (`builtin` for `builtin:addition`): that repository id is served too.

Only the tokenizer's files and the model's config.json are served, never weights.
"""

import functools
import hashlib
import ipaddress
import re
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from tandem.model.config import model_dir
from tandem.model.peft_format import ADAPTER_CONFIG
from tandem.serve.service import Service

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".distcp")
NOT_TOKENIZER = (
    "config.json", "generation_config.json", ADAPTER_CONFIG, "serve.json", "rest.json", "run.json",
    "checksums.json",
)  # fmt: skip


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer's files among a model directory's (tokenizer.json, its config, chat template,
    vocabularies...): every top-level file but weights, configs and tandem's records."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and not p.name.endswith(WEIGHTS + (".index.json",))
        and p.name not in NOT_TOKENIZER
    )


def hub_repo(base_model: str) -> str:
    """The repository id the service serves its tokenizer as: `base_model` when it is a Hugging Face
    hub id (a client that reaches the hub may load it there too), else tandem-serve/<its name>."""
    if HUB_ID.fullmatch(base_model) and ".." not in base_model and not Path(base_model).exists():
        return base_model
    name = re.sub(r"[^\w.]+", "-", Path(base_model.rstrip("/")).name).strip("-.")
    return f"tandem-serve/{name or 'model'}"


def on_this_machine(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def tokenizer_id(request: Request, tokenizer_dir: str, base_model: str) -> str:
    """get_info's tokenizer_id for the client asking: the tokenizer's directory for one on this
    machine, the repository id the service serves it as for any other (the module's docstring)."""
    host = request.client.host if request.client else ""
    return tokenizer_dir if on_this_machine(host) else hub_repo(base_model)


def hub_routes(api: APIRouter, service: Service) -> None:
    """GET/HEAD /hf/<repo>/resolve/<revision>/<file>: huggingface_hub's download of one file, with
    the headers it reads (X-Repo-Commit, ETag) and its error codes (404 RepoNotFound, EntryNotFound).
    Any revision names the one served."""

    @api.api_route("/hf/{repo:path}/resolve/{revision}/{filename:path}", methods=["GET", "HEAD"])
    async def resolve(repo: str, revision: str, filename: str):
        repos = {hub_repo(service.base_model), service.base_model.split(":")[0]}
        if repo not in repos:
            return _missing("RepoNotFound", f"The service's tokenizer is {sorted(repos)}, not {repo!r}.")
        # the trainer's tokenizer (known once a training client built it), else the model's own
        folder = Path(service.tokenizer_dir or model_dir(service.cfg.model.path))
        files = {p.name: p for p in tokenizer_files(folder)}
        if (folder / "config.json").is_file():
            files["config.json"] = folder / "config.json"
        if filename not in files:
            return _missing("EntryNotFound", f"{repo} has no {filename!r}.")
        digests = {name: _digest(p, p.stat().st_mtime_ns) for name, p in sorted(files.items())}
        commit = hashlib.sha1("".join(digests.values()).encode()).hexdigest()
        headers = {"X-Repo-Commit": commit, "ETag": f'"{digests[filename]}"'}
        return FileResponse(files[filename], headers=headers)


def _missing(code: str, message: str) -> Response:
    return Response(message, status_code=404, headers={"X-Error-Code": code, "X-Error-Message": message})


@functools.lru_cache(maxsize=256)
def _digest(path: Path, mtime_ns: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
