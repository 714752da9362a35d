"""`tandem simulate`: the virtual-clock cluster, the closed-form engine, the cost model, and the
simulator's predictions moving the right way when the cluster or the workload changes. No Ray."""

import importlib
import itertools
import json
import math
import re
from pathlib import Path

import pytest

from tandem.cli.main import main
from tandem.errors import TandemError
from tandem.model.config import ModelConfig
from tandem.runtime.startup import load_config
from tandem.sample import Prompt, Sample, Status
from tandem.sim import compare
from tandem.sim.cluster import Job, SimCluster
from tandem.sim.costs import Calibration, Costs, Shape
from tandem.sim.engine import Engine, Seq
from tandem.sim.lengths import ResponseLengths
from tandem.sim.models import model_config
from tandem.sim.run import summarize
from tandem.sim.workers import SimRollout, TimedWorker

ROOT = Path(__file__).resolve().parent.parent
H100 = str(ROOT / "recipes" / "sim-calibration-h100.yaml")
SMALL = [
    "run.steps=6",
    "run.val_every=0",
    "data.val_size=0",
    "rollout.batch_size=16",
    "rollout.n=4",
    "rollout.max_new_tokens=4096",
    "rollout.chunk_groups=2",
    "algo.corrections=[bypass]",
    f"sim.calibration={H100}",
    "sim.model=qwen2.5-1.5b",
    "sim.gpus=[8]",
    "sim.length_mean=600",
    "sim.warmup_steps=2",
]
SPLIT = ["placement.groups=[[actor_train],[generate]]", "placement.ratios=[0.5,0.5]"]


def simulate(*overrides):
    return {r.label: r for r in compare(None, [*SMALL, *overrides]).results}


def costs() -> Costs:
    return Costs(Shape.of(model_config("qwen2.5-7b")), Calibration.load(H100))


def drawn(kind: str, cap: int = 4096) -> list[int]:
    """The lengths `sim.lengths=kind` gives 500 groups of 4."""
    lengths = ResponseLengths(kind, 512.0, 1.0, 2.0, cap, seed=0, batch=64)
    return [lengths.of(Sample(Prompt(), [], group_id=g, index=i)) for g in range(500) for i in range(4)]


def decoded(monkeypatch, *overrides) -> dict[str, dict[tuple[int, int], int]]:
    """Each simulated run's finished responses: (group id, index) -> tokens decoded."""
    runs: dict[str, dict[tuple[int, int], int]] = {}
    module = importlib.import_module("tandem.sim.compare")  # `tandem.sim.compare` is the function
    simulate_run, finish = module.simulate_run, SimRollout._finish

    def one_run(cfg, label, gpus, cal):
        runs[label] = {}
        return simulate_run(cfg, label, gpus, cal)

    def record(worker, s, tokens, status, job):
        if status == Status.FINISHED:
            runs[next(reversed(runs))][(s.group_id, s.index)] = tokens
        finish(worker, s, tokens, status, job)

    monkeypatch.setattr(module, "simulate_run", one_run)
    monkeypatch.setattr(SimRollout, "_finish", record)
    simulate(*overrides)
    return runs


# -- the pieces -------------------------------------------------------------------------------------


class Sleeper(TimedWorker):
    def cost(self, job: Job) -> float:
        return job.args[0]

    def result(self, job: Job, now: float):
        return job.args[-1]


def test_the_cluster_runs_a_lane_one_call_at_a_time_and_waits_for_arguments():
    workers = {"a/0": Sleeper("a/0"), "b/0": Sleeper("b/0")}
    cluster = SimCluster(workers, {"a": ["a/0"], "b": ["b/0"]}, pools={})
    first = cluster.submit("a/0", "f", 2.0, "first")
    second = cluster.submit("a/0", "f", 1.0, "second")  # same lane: after the first
    after = cluster.submit("b/0", "f", 0.5, first)  # gets the first's result, once it has ended
    done = [cluster.wait_next({first, second, after}, 0) for _ in range(3)]
    assert [(d.result, d.handle.end) for d in done] == [("first", 2.0), ("first", 2.5), ("second", 3.0)]
    assert cluster.wait_next({cluster.submit("a/0", "f", math.inf, "never")}, 0) is None


def test_a_shared_pool_slows_its_workers_by_capacity_over_demand():
    workers = {"a/0": Sleeper("a/0", pool="cpus", demand=2.0), "b/0": Sleeper("b/0", pool="cpus", demand=2.0)}
    for w in workers.values():
        w.compute = ("f",)
    cluster = SimCluster(workers, {}, pools={"cpus": 2.0})
    a, b = cluster.submit("a/0", "f", 1.0, "a"), cluster.submit("b/0", "f", 1.0, "b")
    assert cluster.get([a, b], 0) == ["a", "b"] and a.end == pytest.approx(2.0)


def test_the_engine_s_closed_form_equals_stepping_token_by_token():
    c = costs()
    engine = Engine(c, devices=1, max_seqs=3, kv_tokens=math.inf)
    targets, prompt = [5, 40, 17, 9], 100
    seqs = [Seq(Sample(Prompt(), list(range(prompt))), "call", t, 0, prompt, 0) for t in targets]
    engine.add(seqs)
    clock, ended = 0.0, {}
    while engine.busy():
        dt = engine.until_next()
        clock += dt
        ended |= {id(s): clock for s in engine.advance(dt)}
    # by hand: at most 3 decode together; the 4th enters when the first ends
    t, running, done, ctx = 0.0, [0, 1, 2], {}, {i: prompt for i in range(4)}
    left = dict(enumerate(targets))
    while running:
        n, context = len(running), sum(ctx[i] for i in running)
        t += c.decode_step_fixed(n, 1) + c.kv_s_per_token(1) * context
        for i in running:
            left[i] -= 1
            ctx[i] += 1
        for i in [i for i in running if left[i] == 0]:
            running.remove(i)
            done[i] = t
            if 3 not in running and 3 not in done:
                running.append(3)
    for i, s in enumerate(seqs):
        # the closed form lets context grow within a step, stepping adds it after: a token's worth
        assert ended[id(s)] == pytest.approx(done[i], rel=0.02)


def test_decode_is_memory_bound_at_small_batches_and_compute_bound_at_large_ones():
    c = costs()
    assert c.decode_step_fixed(1, 1) == pytest.approx(c.decode_step_fixed(8, 1))  # reading the weights
    big = c.decode_step_fixed(2048, 1), c.decode_step_fixed(4096, 1)
    assert big[1] - c.cal.decode_step_overhead_s == pytest.approx(2 * (big[0] - c.cal.decode_step_overhead_s))
    assert c.decode_step_fixed(1, 4) < c.decode_step_fixed(1, 1)  # tensor parallelism reads a quarter each
    assert c.train_s([1000] * 64, 64, 1) > c.train_s([1000] * 64, 128, 1) > c.train_s([1000] * 64, 64, 1) / 2


def test_one_data_parallel_law_over_every_trainer_size_below_the_reference_too():
    c = costs()  # H100: train_scaling_ref 32, exponent β
    beta, batch = c.cal.train_scaling_exponent, [1000] * 64
    work = [c.train_s(batch, g, 0) for g in (8, 16, 32, 64, 128)]
    # throughput ∝ G^β on either side of the reference: 2x the GPUs, 2^β the speed, never 2x
    for fewer, more in itertools.pairwise(work):
        assert fewer / more == pytest.approx(2**beta)
    assert work[1] < 2 * work[2]  # half the reference's GPUs: faster per GPU, not linear


def test_a_colocated_trainer_runs_at_its_efficiency_of_a_dedicated_one(tmp_path):
    cal = tmp_path / "cal.yaml"
    cal.write_text(Path(H100).read_text() + "colocated_train_efficiency: 0.5\n")
    c = Costs(Shape.of(model_config("qwen2.5-7b")), Calibration.load(cal))
    batch = [1000] * 64
    shared, own = c.train_s(batch, 32, 0, colocated=True), c.train_s(batch, 32, 0)
    assert shared == pytest.approx(2 * own)
    assert c.forward_s(batch, 32, colocated=True) == pytest.approx(2 * c.forward_s(batch, 32))
    assert costs().train_s(batch, 32, 0, colocated=True) == pytest.approx(own)  # default: 1


def test_a_colocated_engines_sleep_and_wake_move_its_weights():
    """A fixed part and the weights out and back at offload_bytes_per_s: a 7B model's take 15x a
    0.5B model's (a constant cost made a tiny model's sync run look 5x slower)."""
    cal = Calibration.load(H100)
    big, small = (Costs(Shape.of(model_config(name)), cal) for name in ("qwen2.5-7b", "qwen2.5-0.5b"))
    for c in (big, small):
        assert c.sleep_s() == pytest.approx(cal.sleep_s + c.weight_bytes / cal.offload_bytes_per_s)
        assert c.wake_s() == pytest.approx(cal.wake_s + c.weight_bytes / cal.offload_bytes_per_s)
    assert big.sleep_s() - cal.sleep_s > 10 * (small.sleep_s() - cal.sleep_s)  # 15x the bytes


def test_a_mixture_of_experts_computes_with_its_active_parameters_and_pushes_all_of_them():
    cal = Calibration.load(H100)
    moe = Costs(Shape.of(model_config("qwen3-30b-a3b")), cal)
    s = moe.shape
    assert s.params == pytest.approx(30.5e9, rel=0.01) and s.active_params == pytest.approx(3.35e9, rel=0.01)
    as_dense = Costs(Shape(s.active_params, s.layers, s.q_dim, s.kv_dim), cal)  # P = the MoE's P_a
    batch = [1000] * 64
    assert moe.train_s(batch, 32, 1) == pytest.approx(as_dense.train_s(batch, 32, 1))
    assert moe.forward_s(batch, 32) == pytest.approx(as_dense.forward_s(batch, 32))
    assert moe.prefill_s(1000, 1) == pytest.approx(as_dense.prefill_s(1000, 1))
    weights = s.params * cal.bytes_per_param  # all 30.5B move, not the 3.35B a token uses
    assert moe.push_s(colocated=False) == pytest.approx(cal.sync_latency_s + weights / cal.link_bytes_per_s)
    assert moe.sleep_s() == pytest.approx(cal.sleep_s + weights / cal.offload_bytes_per_s)
    # decode reads the dense part and min(E, n·k) experts: 8 of 128 at batch 1, all from batch 16
    assert s.params_read(1) == pytest.approx(s.active_params)
    assert s.params_read(16) == s.params_read(512) == s.params
    assert moe.decode_step_fixed(1, 1) < moe.decode_step_fixed(8, 1) < moe.decode_step_fixed(16, 1)
    assert moe.decode_step_fixed(1, 1) == pytest.approx(as_dense.decode_step_fixed(1, 1))
    for dense in (Shape.of(model_config("qwen2.5-7b")), Shape.of(model_config("qwen3-8b"))):
        assert dense.active_params == dense.params_read(1) == dense.params
    tiny = Shape.of(ModelConfig.load(ROOT / "tandem" / "assets" / "warmstart-addition-moe"))  # model.path
    assert tiny.experts == 8 and tiny.active_params < tiny.params


def test_a_file_of_measured_lengths_is_drawn_as_given(tmp_path):
    same = tmp_path / "same.txt"
    same.write_text("# measured\n37\n\n37  # again\n")
    assert set(drawn(f"file:{same}")) == {37}
    two = tmp_path / "two.json"
    two.write_text(json.dumps([100, 100, 100, 900]))
    got = drawn(f"file:{two}")
    assert set(got) == {100, 900} and got.count(900) / len(got) == pytest.approx(0.25, abs=0.03)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"response_length": 5000, "reward": 1.0}\n{"length": 7}\n')
    assert set(drawn(f"file:{rows}", cap=4096)) == {4096, 7}  # capped at rollout.max_new_tokens
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"response_length/mean": 500, "response_length/max": 2000}) + "\n")
    assert sum(drawn(f"metrics:{metrics}")) / 2000 == pytest.approx(500, rel=0.05)


def test_every_mode_decodes_the_same_measured_lengths(tmp_path, monkeypatch):
    file = tmp_path / "lengths.txt"
    file.write_text("100\n900\n")
    runs = decoded(monkeypatch, *SPLIT, f"sim.lengths=file:{file}", "rollout.on_update=abort")
    sync = runs["sync"]
    assert set(runs) == {"sync", "one_step_off", "async"} and set(sync.values()) == {100, 900}
    for run in runs.values():
        both = run.keys() & sync.keys()
        assert len(both) >= 300 and all(run[k] == sync[k] for k in both)


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "does not exist"),
        ("# none\n\n", "holds no response lengths"),
        ("12\n0\n", "line 2 is 0, not a response length"),
        ("12\n3.5\n", "line 2 is '3.5', not a response length"),
        ("[12, -4]", "item 2 is -4, not a response length"),
        ('{"response_length": 3}\n{"tokens": 4}\n', "line 2 has no response_length or length key"),
        ('{"response_length": 3\n', "line 1 is not valid JSON"),
    ],
)
def test_a_bad_file_of_lengths_is_named_with_its_line(tmp_path, text, message):
    path = tmp_path / "lengths.txt"
    if text is not None:
        path.write_text(text)
    with pytest.raises(TandemError, match=re.escape(f"'sim.lengths': {path} {message}")):
        compare(None, [*SMALL, f"sim.lengths=file:{path}"])


def test_a_call_before_its_worker_is_up_waits_for_it():
    worker = Sleeper("a/0")
    worker.ready_at = 5.0
    cluster = SimCluster({"a/0": worker}, {"a": ["a/0"]}, pools={})
    first = cluster.submit("a/0", "f", 1.0, "first")
    second = cluster.submit("a/0", "f", 1.0, "second")
    cluster.get([first, second], 0)
    assert (first.end, second.end) == (6.0, 7.0)  # up at 5 s; later calls do not wait again


def test_the_phases_add_up_to_the_step_and_the_drain_is_left_out():
    runs = simulate(*SPLIT)
    for r in runs.values():
        assert r.wait_s + r.logp_s + r.update_s == pytest.approx(r.step_s)
        assert r.update_s > 0 and r.wait_s >= 0
    assert simulate("algo.corrections=[icepop]")["one_step_off"].logp_s > 0  # π_old recomputed
    steps = [{"timing_s/step": t, "perf/throughput_tokens_per_s": 1.0, "staleness/mean": 0.0,
              "staleness/max": 0.0} for t in (9.0, 2.0, 2.0, 7.0)]  # fmt: skip
    cfg = load_config(None, [*SMALL, "sim.warmup_steps=1"])
    r = summarize(cfg, "sync", 8, "colocated", steps, {"perf/run_samples_per_s": 1.0})
    assert r.step_s == 2.0  # the first fills the pipeline, the last drains it


def test_a_calibration_file_with_a_bad_key_or_value_is_named(tmp_path):
    bad = tmp_path / "cal.yaml"
    bad.write_text("peak_flop: 1.0e+12\n")
    with pytest.raises(TandemError, match=r"unknown key 'peak_flop'"):
        Calibration.load(bad)
    bad.write_text("train_mfu: 1.5\n")
    with pytest.raises(TandemError, match=r"train_mfu must be in \(0, 1\]"):
        Calibration.load(bad)
    with pytest.raises(TandemError, match=r"'sim.calibration'.*does not exist"):
        compare(None, [*SMALL, "sim.calibration=nowhere.yaml"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("sim.gpus=[0]", "'sim.gpus' must be GPU counts >= 1"),
        ("sim.baseline=fast", "'sim.baseline' is 'fast', not a known run label"),
        ("sim.lengths=uniform", "'sim.lengths' is 'uniform'"),
        ("sim.runs=[[a=1]]", r"'sim.runs\[0\]' must be \[label, section.key=value"),
        ("sim.model=gpt-5", "'sim.model' is 'gpt-5', not a shape"),
    ],
)
def test_bad_sim_keys_are_named(override, message):
    with pytest.raises(TandemError, match=message):
        compare(None, [*SMALL, override])


# -- the predictions ----------------------------------------------------------------------------------


def test_a_small_cluster_simulates_every_mode_within_its_staleness_bound():
    runs = simulate(*SPLIT, "run.max_staleness=2")
    assert set(runs) == {"sync", "one_step_off", "async"}
    assert runs["sync"].staleness_max == 0 and runs["one_step_off"].staleness_max <= 1
    assert runs["async"].staleness_max <= 2
    for r in runs.values():
        assert r.samples_per_s > 0 and all(0 <= v <= 1 for v in r.idle.values())
    assert runs["sync"].split == "colocated" and runs["async"].split == "actor_train 0.5 / generate 0.5"


def test_more_rollout_gpus_leave_the_trainer_less_idle_and_more_trainer_gpus_the_rollout():
    few = simulate("placement.groups=[[actor_train],[generate]]", "placement.ratios=[0.75,0.25]")["async"]
    many = simulate("placement.groups=[[actor_train],[generate]]", "placement.ratios=[0.25,0.75]")["async"]
    assert many.idle["train"] < few.idle["train"]
    assert few.idle["rollout"] < many.idle["rollout"]


def test_more_gpus_more_throughput_and_a_longer_tail_makes_sync_wait_more():
    small, big = simulate("sim.gpus=[4]")["sync"], simulate("sim.gpus=[16]")["sync"]
    assert big.samples_per_s > small.samples_per_s
    short, long = simulate("sim.length_sigma=0.3")["sync"], simulate("sim.length_sigma=1.5")["sync"]
    # the engines wait on each batch's slowest response, and the trainer on the engines
    assert long.idle["rollout"] > short.idle["rollout"] and long.idle["train"] > short.idle["train"]


def test_a_larger_staleness_bound_never_slows_async():
    tight = simulate(*SPLIT, "run.max_staleness=0")["async"]
    loose = simulate(*SPLIT, "run.max_staleness=3")["async"]
    assert loose.samples_per_s >= tight.samples_per_s and loose.staleness_max <= 3


def test_the_cli_prints_the_table_and_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", *SMALL, *SPLIT, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "one_step_off" in table
    figures = json.loads(out.read_text())
    assert figures["speedup_sync_8_gpus"] == 1.0
    assert figures["speedup_8_gpus"] == figures["speedup_async_8_gpus"]


def test_the_shipped_simulation_recipes_load():
    for recipe in sorted((ROOT / "recipes").glob("sim-*.yaml")):
        if "calibration" in recipe.name:
            Calibration.load(recipe)
        else:
            load_config(recipe)


def test_every_number_of_a_shipped_calibration_names_its_source():
    """A key's line carries a comment, or the comment block right above its run of keys covers it."""
    for path in sorted((ROOT / "recipes").glob("sim-calibration-*.yaml")):
        covered = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("#"):
                covered = True
            elif not line.strip():
                covered = False
            else:
                assert covered or "#" in line, f"{path.name}:{n} {line!r} names no source"
