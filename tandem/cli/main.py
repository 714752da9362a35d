"""`tandem train | sft | eval | generate | export | convert | data make | simulate | report | serve`
— the command line.

A TandemError (bad config, bad data, unknown name, a bad flag) prints as one paragraph and exits
with 2, as does a file-system error about a path; anything else is a bug and keeps its traceback.
`tandem train` stopped by SIGINT / SIGTERM saves a checkpoint, prints how to resume and exits with
130 / 143, as a shell reports those signals.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator

from tandem.errors import TandemError


class Parser(argparse.ArgumentParser):
    """argparse with its errors as TandemErrors: one paragraph naming the flag, exit 2, like the rest."""

    def error(self, message: str):  # argparse's own prints the usage and exits
        raise TandemError(f"{self.prog}: {message}. See `{self.prog} --help`.")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low (argparse names the flag in the error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


@contextlib.contextmanager
def flags_named(flags: dict[str, str]) -> Iterator[None]:
    """A TandemError about a config key that a flag set names the flag instead (`rollout.n` -> `--n`):
    the checks stay in one place (the config's), and the user reads what they typed."""
    try:
        yield
    except TandemError as e:
        message = str(e)
        for key, flag in flags.items():
            pattern = rf"(Config )?'?{re.escape(key)}(?![\w.])'?(=)?"
            message = re.sub(pattern, lambda m, flag=flag: flag + (" " if m.group(2) else ""), message)
        raise TandemError(message) from None


def split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """[recipe.yaml] [key=value ...] -> (recipe, overrides)."""
    recipe, overrides = None, []
    for a in args:
        if "=" in a:
            overrides.append(a)
        elif recipe is None and a.endswith((".yaml", ".yml")):
            recipe = a
        else:
            raise TandemError(
                f"Argument {a!r} is neither a recipe (.yaml) nor an override (section.key=value)."
            )
    return recipe, overrides


def cmd_train(ns: argparse.Namespace) -> int:
    from tandem.controller.recovery import Stopped
    from tandem.runtime.run import run_training
    from tandem.runtime.startup import load_config

    try:  # run_training checks that run.out_dir is writable before anything starts
        summary = run_training(load_config(*split_args(ns.args)))
    except Stopped as e:  # SIGINT / SIGTERM: one line, how to go on, the shell's exit code for it
        args = " ".join([a for a in ns.args if not a.startswith("run.resume=")] + ["run.resume=auto"])
        saved = f"checkpoint {e.checkpoint}" if e.checkpoint else "no checkpoint yet"
        print(f"stopped by {e.signal} after step {e.version} ({saved}); continue with: tandem train {args}")
        return 128 + int(getattr(signal.Signals, e.signal))
    if "val/accuracy_start" in summary:
        print(
            f"held-out accuracy: {100 * summary['val/accuracy_start']:.1f}% at the start -> "
            f"{100 * summary['val/accuracy_final']:.1f}% at the end "
            f"({summary['val/accuracy_gain_points']:+.1f} points)"
        )
    else:
        print(
            f"final mean training score: {summary['critic/score/mean_final']:.3f} (no validation data: "
            "set data.val_files for held-out accuracy)"
        )


def cmd_sft(ns: argparse.Namespace) -> None:
    from tandem.runtime.startup import SFT_PATHS, load_config, resolve_inputs
    from tandem.train.sft import run_sft

    cfg = resolve_inputs(load_config(*split_args(ns.args)), check_tokenizer=False, keys=SFT_PATHS)
    print(f"saved {run_sft(cfg)}")  # on this process's CPU threads: it reads no run.device


def cmd_eval(ns: argparse.Namespace) -> None:
    from tandem.runtime.standalone import evaluate_checkpoint
    from tandem.runtime.startup import load_config

    recipe, overrides = split_args(ns.args)
    flags = {}
    if ns.model:
        overrides.append(f"model.path={ns.model}")
        flags["model.path"] = "--model"
    if ns.data:
        overrides.append(f"data.val_files=[{json.dumps(ns.data)}]")
        flags["data.val_files"] = "--data"
    with flags_named(flags):
        metrics = evaluate_checkpoint(load_config(recipe, overrides), show=ns.show)
    print(json.dumps(metrics, indent=2))


def cmd_generate(ns: argparse.Namespace) -> None:
    from tandem.runtime.standalone import generate_text
    from tandem.runtime.startup import load_config

    if not ns.prompt.strip():  # the model would continue nothing but the chat template's header
        raise TandemError(
            "tandem generate: the prompt is empty. Give the text to answer or continue, e.g. "
            "tandem generate '12+30='."
        )
    recipe, overrides = split_args(ns.args)  # as `tandem eval` takes them; the flags win
    flags = {"rollout.n": "--n", "rollout.temperature": "--temperature"}
    flags |= {"rollout.max_new_tokens": "--max-new-tokens", **({"model.path": "--model"} if ns.model else {})}
    overrides += [f"{key}={getattr(ns, flag[2:].replace('-', '_'))}" for key, flag in flags.items()]
    with flags_named(flags):
        texts = generate_text(load_config(recipe, overrides), ns.prompt, chat=not ns.raw)
    for i, text in enumerate(texts):
        print(f"[{i}] {text}")


def cmd_export(ns: argparse.Namespace) -> None:
    from tandem.model.export import export_checkpoint

    out = export_checkpoint(ns.checkpoint, ns.out, merge=ns.merge, dtype=ns.dtype)
    what = "a full Hugging Face checkpoint, the adapter merged" if ns.merge else "the adapter alone"
    print(f"saved {out} ({what})")


def cmd_convert(ns: argparse.Namespace) -> None:
    from tandem.model.config import ModelConfig
    from tandem.model.convert import convert_checkpoint

    print(convert_checkpoint(ns.src, ns.out, ModelConfig.from_hf).line())


def cmd_data_make(ns: argparse.Namespace) -> None:
    from tandem.data.tasks import make_dataset

    print(f"wrote {make_dataset(ns.task, ns.out, n=ns.n, seed=ns.seed, split=ns.split)}")


def cmd_simulate(ns: argparse.Namespace) -> None:
    from tandem.sim import compare, search

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    recipe, overrides = split_args(ns.args)
    figures = {}
    if ns.calibrate:  # then the recipe's runs on what was measured
        figures = calibrate_here(recipe, overrides, ns, say)
        overrides = [*overrides, f"sim.calibration={os.path.abspath(ns.out)}"]
    result = compare(recipe, overrides, progress=say)
    print(result.table())
    figures |= result.figures()
    if ns.search:
        print("\nbest split and staleness bound for async (--search):")
        for best in search(recipe, overrides, progress=say):
            print(best.line())
            figures |= best.figures()
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(figures, f, indent=2)


def calibrate_here(recipe: str | None, overrides: list[str], ns: argparse.Namespace, say) -> dict[str, float]:
    """`tandem simulate --calibrate`: measure this machine's parts into a calibration file (--out)
    -> the figures measured, under calibration_*."""
    from tandem.runtime.startup import load_config
    from tandem.sim.calibrate import calibrate, write

    cal, figures = calibrate(load_config(recipe, overrides), with_ray=not ns.no_ray, say=say)
    command = " ".join(["tandem simulate --calibrate", *ns.args])
    write(cal, figures, ns.out, command)
    print(f"wrote {ns.out} (use it with sim.calibration={ns.out}); the recipe's runs on it:")
    return {f"calibration_{k}": v for k, v in figures.items()}


def cmd_serve(ns: argparse.Namespace) -> None:
    # The trainer and the engine compute on two threads of this process, each with an OpenMP team;
    # a team that spins while it waits (libgomp's default) takes the core the other needs. Set
    # before torch is imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from tandem.runtime.startup import load_config
    from tandem.serve.app import serve

    recipe, overrides = split_args(ns.args)
    # Checkpoints go to runs/serve/ unless the recipe or an override names the run (later ones win).
    serve(load_config(recipe, ["run.name=serve", *overrides]), ns.host, ns.port, ns.api_key, ns.full_weights)


def add_serve(sub) -> None:
    s = sub.add_parser("serve", help="a training service speaking the Tinker API (the tinker SDK's loops)")
    s.add_argument(
        "args", nargs="*", help="[recipe.yaml] [section.key=value ...]: the model, engine, devices"
    )
    s.add_argument("--host", default="127.0.0.1", help="any address but loopback needs --api-key")
    s.add_argument("--port", type=at_least(1), default=8000)
    s.add_argument(
        "--api-key", default="", help="tml-...: required of every request (or TANDEM_SERVE_API_KEY)"
    )
    s.add_argument(
        "--full-weights", action="store_true", help="train every weight, whatever LoRA rank is asked"
    )
    s.set_defaults(fn=cmd_serve)


def cmd_report(ns: argparse.Namespace) -> None:
    from tandem.report import write_report

    pngs = write_report(ns.runs, ns.out)
    print(f"wrote {ns.out} and {len(pngs)} PNGs in {pngs[0].parent if pngs else '-'}")


def add_report(sub) -> None:
    r = sub.add_parser("report", help="one HTML page of a run's plots (several runs overlaid)")
    r.add_argument("runs", nargs="+", help="run directories (runs/<name>)")
    r.add_argument("--out", default="report.html", help="the page (PNG copies go to <stem>_png/)")
    r.set_defaults(fn=cmd_report)


def add_simulate(sub) -> None:
    s = sub.add_parser("simulate", help="the loop on a virtual clock: modes, splits, speedups")
    s.add_argument("args", nargs="*", help="[recipe.yaml] [section.key=value ...] (sim.* among them)")
    s.add_argument("--search", action="store_true", help="also find the split and staleness bound for async")
    s.add_argument("--json", help="write the figures as one flat JSON object")
    s.add_argument("--calibrate", action="store_true", help="measure this machine's parts into --out")
    s.add_argument("--out", default="sim-calibration.yaml", help="--calibrate: the calibration file to write")
    s.add_argument("--no-ray", action="store_true", help="--calibrate: leave out the actors' parts (Ray)")
    s.set_defaults(fn=cmd_simulate)


def version() -> str:
    """The installed package's version (pyproject.toml), or the source tree's when not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("tandem")
    except PackageNotFoundError:
        from tandem import __version__

        return __version__


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a command's recipe and overrides may also come after its flags
    (`tandem generate "2+2=" --model DIR rollout.dtype=float32`), where argparse alone stops at them."""
    p = parser()
    ns, rest = p.parse_known_args(argv)
    if rest and hasattr(ns, "args") and not any(r.startswith("-") for r in rest):
        ns.args = [*ns.args, *rest]
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    return ns


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="tandem", description="Asynchronous RL post-training for language models.")
    p.add_argument("--version", action="version", version=f"tandem {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, text in [
        ("train", cmd_train, "RL-train a policy (default: the built-in addition run)"),
        ("sft", cmd_sft, "supervised warm start on a synthetic task"),
    ]:
        s = sub.add_parser(name, help=text)
        s.add_argument("args", nargs="*", help="[recipe.yaml] [section.key=value ...]")
        s.set_defaults(fn=fn)
    e = sub.add_parser("eval", help="accuracy of a checkpoint on a dataset")
    e.add_argument("args", nargs="*", help="[recipe.yaml] [section.key=value ...]")
    e.add_argument("--model", help="checkpoint directory, or LoRA adapter directory (default: model.path)")
    e.add_argument("--data", help="JSONL/parquet file (default: the task's held-out split)")
    e.add_argument("--show", type=at_least(0), default=0, help="print this many prompts with their responses")
    e.set_defaults(fn=cmd_eval)
    g = sub.add_parser("generate", help="sample responses to a prompt")
    g.add_argument("prompt")
    g.add_argument(
        "args", nargs="*", help="[recipe.yaml] [section.key=value ...], e.g. rollout.dtype=float32"
    )
    g.add_argument("--model", help="checkpoint or LoRA adapter directory (default: the built-in warm start)")
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(fn=cmd_generate)
    x = sub.add_parser("export", help="a LoRA checkpoint merged into a full model, or its adapter alone")
    x.add_argument("checkpoint", help="a LoRA run's step directory, or a PEFT adapter directory")
    x.add_argument("--out", required=True, help="a new directory")
    x.add_argument("--merge", action="store_true", help="fold the adapter into the base's weights")
    x.add_argument("--dtype", default="", help="--merge: float32, bfloat16 or float16 (default: the base's)")
    x.set_defaults(fn=cmd_export)
    c = sub.add_parser("convert", help="a GGUF file or Hugging Face checkpoint as a directory tandem loads")
    c.add_argument("src", help="a .gguf file (dequantised), or a Hugging Face checkpoint directory")
    c.add_argument("out", help="a new directory: float32 config.json + model.safetensors + tokenizer")
    c.set_defaults(fn=cmd_convert)
    d = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    m = d.add_parser("make", help="write a synthetic task dataset (JSONL or parquet by extension)")
    tasks = "addition, countdown, multiply, reverse, or reasoning_gym:<dataset> (default config)"
    m.add_argument("task", help=tasks)
    m.add_argument("--out", required=True)
    m.add_argument("--n", type=at_least(1), default=1000)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--split", choices=["train", "test"], default="train")
    m.set_defaults(fn=cmd_data_make)
    add_simulate(sub)
    add_report(sub)
    add_serve(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    # As `python -m` would: reward functions named `my_pkg.rewards:score` resolve from the current dir.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        ns = parse(argv)
        return ns.fn(ns) or 0
    except TandemError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)  # one paragraph, whatever it quotes
        return 2
    except OSError as e:
        if e.filename is None:  # not about a file: a bug or the system's, keep the traceback
            raise
        # A file-system refusal (permissions, a full disk, a file where a directory should be) is
        # the user's to fix, and a traceback would bury which path it was.
        print(f"error: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a run's own handler is up (it saves at a step's end)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
