"""The default run beside a busy core: wall time against the same run on an idle machine.

    python bench/load.py [--repeats 3] [--busy 1] [--json PATH] [-- override ...]

Runs `tandem train` (the built-in default, plus any overrides after `--`) --repeats times on the
machine as it is and --repeats times beside --busy processes that spin a core each
(`while True: pass`), alternating idle and busy. Prints each run's wall time, the medians, and
`load_ratio` = median busy / median idle (issue 25's goal: <= 2.5 with one busy core of two).
`--json` writes {"idle_s", "busy_s", "load_ratio", "busy_processes", "cpu"} as one flat object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tandem.determinism import machine


def train(overrides: list[str], out_dir: str) -> float:
    start = time.monotonic()
    command = ["tandem", "train", f"run.out_dir={out_dir}", "run.progress=false", *overrides]
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy", type=int, default=1, help="processes spinning a core each beside the busy runs")
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*", help="config overrides for tandem train (after --)")
    args = p.parse_args()
    times: dict[str, list[float]] = {"idle": [], "busy": []}
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.repeats):
            for kind in ("idle", "busy"):
                spinners = [
                    subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(args.busy if kind == "busy" else 0)
                ]
                try:
                    seconds = train([*args.overrides, f"run.name={kind}{i}"], out)
                finally:
                    for s in spinners:
                        s.kill()
                        s.wait()
                times[kind].append(seconds)
                print(f"{kind} run {i + 1}: {seconds:.1f} s", flush=True)
    idle, busy = statistics.median(times["idle"]), statistics.median(times["busy"])
    cpu = f"{machine('cpu')}, {os.cpu_count()} cores"
    print(
        f"median idle {idle:.1f} s, beside {args.busy} busy core(s) {busy:.1f} s: {busy / idle:.2f}x ({cpu})"
    )
    if args.json:
        figures = dict(idle_s=idle, busy_s=busy, load_ratio=busy / idle, busy_processes=args.busy, cpu=cpu)
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
