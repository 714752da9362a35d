"""Kill runs at random moments and resume them: is anything lost, trained twice, or different?

Each scenario starts `tandem train` as its own process tree, waits for a random step (after the
first checkpoint; then a random fraction of a step more, so some kills land in the middle of a
save), and SIGKILLs one thing:

    driver    the whole process tree (driver, Ray, every actor): `run.resume=auto` continues
    train     the train worker's process: the run must stop, naming it; then `run.resume=auto`
    reward    the reward actor's process: Ray restarts it and its calls run again
    rollout   a rollout worker's process: Ray restarts it and the loop re-syncs and re-submits

Then it checks the run directory: every prompt group trained exactly once (`batches.jsonl`: none
lost, none twice), the staleness bound held at every step, and, in sync mode, every step's metrics
(less wall-clock ones) and the final weights equal those of an uninterrupted run bit for bit. Last,
the cost of `run.save_every=5` on the mean step time, measured side by side with `save_every=0`.

    python bench/chaos.py [--steps 10] [--json PATH]
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

BASE = [
    "run.progress=false",
    "run.val_every=0",
    "run.save_every=2",
    "run.timeout_s=120",
    "rollout.batch_size=8",
    "rollout.n=4",
    "data.val_size=16",
    "reward.num_workers=1",
]
MODES = {
    "sync": (["run.mode=sync"], 0),
    "one_step_off": (["run.mode=one_step_off", "run.generate_ahead_steps=1"], 1),
    "async": (["run.mode=async", "run.max_staleness=2", "rollout.chunk_groups=2"], 2),
}
# (mode, what is killed): 12 kills across the modes and targets.
SCENARIOS = [
    ("sync", "driver"),
    ("sync", "driver"),
    ("sync", "driver"),
    ("sync", "train"),
    ("one_step_off", "driver"),
    ("one_step_off", "driver"),
    ("one_step_off", "rollout"),
    ("async", "driver"),
    ("async", "driver"),
    ("async", "train"),
    ("async", "reward"),
    ("async", "rollout"),
]
ACTOR = {"train": "ray::TrainActor", "reward": "ray::RewardActor", "rollout": "ray::RolloutActor"}


def start(out: Path, overrides: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tandem.cli.main", "train", f"run.out_dir={out}", *overrides]
    log = open(out / "log.txt", "a")  # noqa: SIM115 (the child writes it while we wait)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def session(proc: subprocess.Popen) -> list[tuple[int, str]]:
    """(pid, command line) of every process of the run's session: the driver, Ray's processes and
    every actor (Ray gives actors their own process group, not their own session)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getsid(int(entry.name)) == proc.pid:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                out.append((int(entry.name), cmdline))
        except (OSError, ProcessLookupError):
            pass
    return out


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_tree(proc: subprocess.Popen) -> None:
    for pid, _ in session(proc):
        kill(pid)
    proc.wait()


def kill_actor(proc: subprocess.Popen, target: str) -> bool:
    for pid, cmdline in session(proc):
        if cmdline.startswith(ACTOR[target]):
            kill(pid)
            return True
    return False


def steps_logged(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "version" in r]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> float:
    """Block until `step` is logged -> the mean step time so far."""
    while proc.poll() is None:
        logged = steps_logged(run_dir)
        if len(logged) >= step:
            return statistics.mean(r["timing_s/step"] for r in logged)
        time.sleep(0.2)
    log = run_dir.parent / "log.txt"
    raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {step}: see {log}")


def learning(run_dir: Path) -> dict[int, dict]:
    rows = steps_logged(run_dir)
    drop = ("timing_s/", "perf/")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(drop)} for r in rows}


def final_weights(run_dir: Path) -> dict:
    return load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))


def check(run_dir: Path, steps: int, batch: int, bound: int) -> dict[str, int | bool]:
    lines = (run_dir / "batches.jsonl").read_text().splitlines()
    trained = [g for line in lines for g in json.loads(line)["groups"]]
    logged = [r["step"] for r in steps_logged(run_dir)]
    return {
        "groups_lost": steps * batch - len(set(trained)),
        "groups_trained_twice": len(trained) - len(set(trained)),
        "steps_logged_twice": len(logged) - len(set(logged)),
        "staleness_ok": all(r["staleness/max"] <= bound for r in steps_logged(run_dir)),
        "finished": (run_dir / "summary.json").exists(),
    }


def scenario(i: int, mode: str, target: str, args, root: Path, rng: random.Random, reference: Path) -> dict:
    out = root / f"{i:02d}-{mode}-{target}"
    out.mkdir()
    run_dir = out / "default"
    overrides = [*BASE, *MODES[mode][0], f"run.steps={args.steps}", f"run.seed={args.seed}"]
    proc = start(out, overrides)
    at = rng.randint(2, args.steps - 3)
    step_s = wait_for_step(proc, run_dir, at)
    time.sleep(rng.uniform(0, step_s))
    result: dict = {"mode": mode, "target": target, "killed_after_step": at}
    killed = time.time()
    if target == "driver":
        kill_tree(proc)
    else:
        if not kill_actor(proc, target):
            kill_tree(proc)
            raise RuntimeError(f"no {ACTOR[target]} process found under the run: see {out / 'log.txt'}")
        proc.wait(timeout=args.steps * 60)
        if target == "train":
            result["seconds_to_detect"] = time.time() - killed
            log = (out / "log.txt").read_text()
            result["error_names_worker"] = proc.returncode == 2 and "train/0 died" in log
        kill_tree(proc)  # whatever Ray left behind
    resumed = 0
    if not (run_dir / "summary.json").exists():
        proc = start(out, [*overrides, "run.resume=auto"])
        proc.wait(timeout=args.steps * 120)
        resumed = 1
        if proc.returncode != 0:
            raise RuntimeError(f"the resumed run failed (exit {proc.returncode}): see {out / 'log.txt'}")
    result["resumed"] = resumed
    result.update(check(run_dir, args.steps, 8, MODES[mode][1]))
    if mode == "sync":
        a, b = learning(reference), learning(run_dir)
        wa, wb = final_weights(reference), final_weights(run_dir)
        result["bitwise_equal"] = a == b and wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)
    print(json.dumps(result), flush=True)
    return result


def run_to_end(out: Path, overrides: list[str]) -> Path:
    out.mkdir()
    proc = start(out, overrides)
    if proc.wait() != 0:
        raise RuntimeError(f"run failed (exit {proc.returncode}): see {out / 'log.txt'}")
    return out / "default"


def save_overhead(args, root: Path) -> float:
    """Mean step time with run.save_every=5 over the same without, from interleaved runs."""
    times: dict[int, list[float]] = {0: [], 5: []}
    for r in range(args.overhead_repeats):
        for every in (0, 5):
            steps = f"run.steps={args.overhead_steps}"
            overrides = [*BASE, "run.mode=sync", steps, f"run.save_every={every}"]
            run_dir = run_to_end(root / f"overhead-{every}-{r}", overrides)
            times[every].append(statistics.mean(s["timing_s/step"] for s in steps_logged(run_dir)))
    return statistics.median(times[5]) / statistics.median(times[0]) - 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="the runs' run.seed and the kill moments' RNG")
    p.add_argument("--overhead-steps", type=int, default=20)
    p.add_argument("--overhead-repeats", type=int, default=2)
    p.add_argument("--only", default="", help="scenarios as mode:target,... (default: all 12)")
    p.add_argument("--json", help="write the figures as one flat JSON object")
    args = p.parse_args()
    rng = random.Random(args.seed)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    root = Path(tempfile.mkdtemp(prefix="chaos-"))  # kept: each run's log.txt and run directory
    print(f"runs in {root}", flush=True)
    chosen = [s for s in SCENARIOS if not args.only or f"{s[0]}:{s[1]}" in args.only.split(",")]
    reference = run_to_end(
        root / "reference", [*BASE, *MODES["sync"][0], f"run.steps={args.steps}", f"run.seed={args.seed}"]
    )
    results = [scenario(i, *what, args, root, rng, reference) for i, what in enumerate(chosen)]
    overhead = save_overhead(args, root) if args.overhead_repeats else float("nan")
    detect = [r["seconds_to_detect"] for r in results if "seconds_to_detect" in r]
    figures = {
        "kills": len(results),
        "runs_resumed": sum(r["resumed"] for r in results),
        "groups_lost": sum(r["groups_lost"] for r in results),
        "groups_trained_twice": sum(r["groups_trained_twice"] for r in results),
        "steps_logged_twice": sum(r["steps_logged_twice"] for r in results),
        "staleness_bound_held": all(r["staleness_ok"] for r in results),
        "runs_finished": sum(r["finished"] for r in results),
        "sync_bitwise_equal": all(r["bitwise_equal"] for r in results if "bitwise_equal" in r),
        "dead_train_worker_named": all(r["error_names_worker"] for r in results if "error_names_worker" in r),
        "max_seconds_to_detect_dead_worker": max(detect) if detect else float("nan"),
        "save_every_5_step_time_overhead": overhead,
    }
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
