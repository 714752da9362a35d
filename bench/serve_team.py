"""Several tinker-cookbook loops on one `tandem serve` against the same loops one after another, each
on a service of its own: the team's wall-time ratio, each loop's reward, and the sampler–trainer gap.

Each loop is the cookbook's own RL recipe, unmodified (`tinker_cookbook.recipes.math_rl.train`,
env=arithmetic, renderer role_colon), with its own seed. `together`: N loops start at once against
one service (their adapters trained in turn on its one trainer, their samples grouped by adapter
on its one engine). `apart`: the same N loops one after another, each on a fresh service started
before its clock starts. Services start outside the timed spans either way.

    python bench/serve_team.py [--loops 4] [--steps 10] [--model builtin:addition] [--deterministic]
                               [--json PATH]

`--json` writes together_vs_apart (wall time together / the sum apart), together_s, apart_s,
reward_final_together_<i> / reward_final_apart_<i> (each loop's last `env/all/reward/total`),
kl_sample_train_max_abs (the largest |optim/kl_sample_train_v1| of any loop's step together),
loops, steps, deterministic and cpu. Needs the cookbook (README, "Tinker cookbook").
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.determinism import machine
from tandem.model.config import resolve_model_path

KEY = "tml-local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(model: str, out: Path, deterministic: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["serve", "--port", str(port), f"model.path={model}", f"run.out_dir={out}"]
    args += ["run.deterministic=true"] if deterministic else []
    command = [sys.executable, "-m", "tandem.cli.main", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = process.stdout.readline()
    if "on http" not in line:
        raise SystemExit(f"tandem serve did not start: {line}{process.stdout.read()}")
    return process, f"http://127.0.0.1:{port}"


def loop(url: str, model: str, log: Path, steps: int, seed: int) -> subprocess.Popen:
    args = [
        f"base_url={url}",
        f"model_name={model}",
        "renderer_name=role_colon",
        "env=arithmetic",
        "groups_per_batch=8",
        "group_size=4",
        f"max_steps={steps}",
        "lora_rank=8",
        f"seed={seed}",
        "learning_rate=1e-4",
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
        "eval_every=0",
        "save_every=0",
    ]
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait(p: subprocess.Popen) -> None:
    _, err = p.communicate()
    if p.returncode != 0:
        raise SystemExit(f"a cookbook loop failed:\n{err[-3000:]}")


def rows(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model", default="builtin:addition")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = str(resolve_model_path(a.model).resolve())  # the cookbook loads its tokenizer by this name
    root = Path(tempfile.mkdtemp(prefix="tandem-team-"))
    figures: dict = {"loops": a.loops, "steps": a.steps, "deterministic": a.deterministic}
    figures["cpu"] = machine("cpu")

    service, url = start_service(model, root / "together-serve", a.deterministic)
    try:
        start = time.perf_counter()
        running = [loop(url, model, root / f"together-{i}", a.steps, i) for i in range(a.loops)]
        for p in running:
            wait(p)
        figures["together_s"] = time.perf_counter() - start
    finally:
        stop(service)
    apart = 0.0
    for i in range(a.loops):
        service, url = start_service(model, root / f"apart-serve-{i}", a.deterministic)
        try:
            start = time.perf_counter()
            wait(loop(url, model, root / f"apart-{i}", a.steps, i))
            apart += time.perf_counter() - start
        finally:
            stop(service)
    figures["apart_s"] = apart
    figures["together_vs_apart"] = figures["together_s"] / apart
    gaps = []
    for i in range(a.loops):
        together, alone = rows(root / f"together-{i}"), rows(root / f"apart-{i}")
        figures[f"reward_final_together_{i}"] = together[-1]["env/all/reward/total"]
        figures[f"reward_final_apart_{i}"] = alone[-1]["env/all/reward/total"]
        gaps += [abs(r["optim/kl_sample_train_v1"]) for r in together]
    figures["kl_sample_train_max_abs"] = max(gaps)
    print(
        f"{a.loops} cookbook loops of {a.steps} steps on one service: {figures['together_s']:.1f} s; "
        f"one after another, each on its own: {apart:.1f} s; ratio {figures['together_vs_apart']:.2f} "
        f"({figures['cpu']}); max |kl_sample_train_v1| together {figures['kl_sample_train_max_abs']:.3g}"
    )
    for i in range(a.loops):
        print(
            f"  loop {i}: final reward together {figures[f'reward_final_together_{i}']:.3f}, "
            f"apart {figures[f'reward_final_apart_{i}']:.3f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
