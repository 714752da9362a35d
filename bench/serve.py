"""The same RL loop through `tandem serve` (the Tinker SDK's loop, examples/tinker_rl.py) and as
`tandem train`, with matching settings: the time ratio, and where the service's overhead goes.

    python bench/serve.py [--steps 10] [--json PATH]

Both sides: the built-in default task from builtin:addition, 32 prompts x 8 samples per step, 8
new tokens at temperature 1, GRPO advantages (mean / std of each group), the loss a mean over the
batch's response tokens, full weights, AdamW at lr 1e-4, betas (0.9, 0.999), grad clip 1, a weight
push to the engine after every step. `tandem train` runs its default recipe for --steps steps
(sync mode, one process: generate, reward, train, push, in turn); its loop time is the sum of its
steps' `timing_s/step`. The service runs `tandem serve --full-weights` in a subprocess and the
example loop here with no held-out evaluation; its loop time is the example's. On the service side
the seconds of each worker call (`/tandem/timings`: sample = generate, forward_backward,
optim_step, push = the weights' snapshot and the engine taking them) are read before and after
the loop; what the loop took beyond them is the service's overhead: HTTP, protobuf and JSON, the
futures' polling, and the client's own work (tokenizing, decoding, rewards, building datums),
which `tandem train` does in its workers.

Prints the ratio (service / train) and the per-step parts; `--json` writes them as one flat object.
Both runs share the machine's cores in turn, never at once.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-bench"


def train_side(steps: int, out: Path) -> dict[str, float]:
    """`tandem train` for `steps` steps -> its per-step seconds, whole and in parts."""
    command = ["tandem", "train", f"run.steps={steps}", "run.val_every=0", f"run.out_dir={out}"]
    subprocess.run([*command, "run.name=bench", "run.progress=false"], check=True, cwd=ROOT)
    rows = [json.loads(line) for line in (out / "bench" / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "timing_s/step" in r]
    mean = lambda key: sum(r.get(key, 0.0) for r in steps_rows) / len(steps_rows)  # noqa: E731
    return {
        "train_step_s": mean("timing_s/step"),
        "train_generate_s": mean("timing_s/generate"),
        "train_reward_s": mean("timing_s/reward"),
        "train_train_s": mean("timing_s/train"),
        "train_sync_s": mean("timing_s/sync"),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(out: Path):
    """`tandem serve --full-weights` in a subprocess -> its URL once it answers."""
    port = free_port()
    command = ["tandem", "serve", "--full-weights", "--port", str(port), f"run.out_dir={out}"]
    process = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/api/v1/healthz").status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(30)


def service_side(steps: int, out: Path) -> dict[str, float]:
    """The example loop against the service -> its per-step seconds, whole and in parts."""
    spec = importlib.util.spec_from_file_location("tinker_rl", ROOT / "examples" / "tinker_rl.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    os.environ["TINKER_API_KEY"] = KEY
    with service(out) as url:
        args = ["--base-url", url, "--steps", str(steps), "--lr", "1e-4", "--held-out", "0"]
        before = httpx.get(f"{url}/tandem/timings").json()
        loop_s = example.main(args)["loop_s"]
        after = httpx.get(f"{url}/tandem/timings").json()
    spent = {k: (v - before.get(k, 0.0)) / steps for k, v in after.items()}
    parts = {
        "serve_sample_s": spent.get("rollout.sample", 0.0),
        "serve_forward_backward_s": spent.get("train.forward_backward", 0.0),
        "serve_optim_step_s": spent.get("train.optim_step", 0.0),
        "serve_push_s": spent.get("push", 0.0) + spent.get("rollout.serve_weights", 0.0),
    }
    step_s = loop_s / steps
    return {"serve_step_s": step_s, **parts, "serve_overhead_s": step_s - sum(parts.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", help="write the figures as one flat JSON object")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        figures = train_side(args.steps, Path(tmp) / "train") | service_side(args.steps, Path(tmp) / "serve")
    figures["serve_vs_train_ratio"] = figures["serve_step_s"] / figures["train_step_s"]
    figures["steps"] = args.steps
    serve_s, train_s = figures["serve_step_s"], figures["train_step_s"]
    print(f"per step: tandem serve {serve_s:.2f} s, tandem train {train_s:.2f} s")
    print(f"serve_vs_train_ratio {figures['serve_vs_train_ratio']:.2f}")
    for key, value in figures.items():
        print(f"  {key} {value:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    sys.exit(main())
