"""The tinker-cookbook's own RL recipe (`tinker_cookbook.recipes.math_rl.train`), unmodified, against
a real `tandem serve` process on the toy model: one loop runs to "Training completed
successfully", and four loops at once in run.deterministic mode each log a sampler–trainer gap
(`optim/kl_sample_train_v1`) of exactly 0 at every step, their adapters mixed on one service.

The cookbook (0.5.8, the newest this registry installs) is installed with --no-deps (README,
"Tinker cookbook"): it pins transformers <= 5.5.4, below what vLLM's CPU build runs here. It loads
its tokenizer by model name with transformers, so the service's model is named by its directory
(a hub id would need the network; `rl_loop`/`sl_loop` pick a renderer by model name and know no
small model, and `chat_sl` downloads its data: neither runs offline here).
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook.recipes.math_rl.train", reason="tinker-cookbook not installed (README)")

from tandem.model.config import resolve_model_path  # noqa: E402

pytestmark = pytest.mark.integration
KEY = "tml-local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, str, str]:
    """`tandem serve` on the toy model, named by its directory -> (process, URL, model name)."""
    model = str(resolve_model_path("builtin:addition").resolve())
    port = free_port()
    args = ["serve", "--port", str(port), f"model.path={model}", f"run.out_dir={tmp_path / 'serve'}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli.main", *args, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = process.stdout.readline()
    assert "on http" in line, line + process.stdout.read()
    return process, f"http://127.0.0.1:{port}", model


def cookbook_loop(url: str, model: str, log: Path, steps: int) -> subprocess.Popen:
    args = [
        f"base_url={url}",
        f"model_name={model}",
        "renderer_name=role_colon",
        "env=arithmetic",
        "groups_per_batch=4",
        "group_size=4",
        f"max_steps={steps}",
        "lora_rank=8",
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
        "eval_every=0",
        "save_every=0",
    ]
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def finished(loop: subprocess.Popen, timeout_s: float = 300) -> str:
    out, _ = loop.communicate(timeout=timeout_s)
    assert loop.returncode == 0 and "Training completed successfully" in out, out[-3000:]
    return out


def metrics(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()


def test_four_cookbook_loops_at_once_see_no_sampler_trainer_gap_in_deterministic_mode(tmp_path):
    service, url, model = start_service(tmp_path, "run.deterministic=true")
    try:
        logs = [tmp_path / f"loop{i}" for i in range(4)]
        loops = [cookbook_loop(url, model, log, steps=3) for log in logs]
        start = time.monotonic()
        for loop in loops:
            finished(loop)
        assert time.monotonic() - start < 300
        for log in logs:
            rows = metrics(log)
            assert len(rows) == 3
            gaps = [r["optim/kl_sample_train_v1"] for r in rows]
            assert gaps == [0.0] * 3, gaps
    finally:
        stop(service)
