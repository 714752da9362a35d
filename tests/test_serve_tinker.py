"""`tandem serve` driven by the official `tinker` SDK: SFT lowers the loss, bad requests get the SDK's
errors and leave the service up (an unexpected error fails its request only), a checkpoint survives
a killed service bit for bit and a kill during an overwriting save, a damaged one is refused, and
(integration) the SDK-style RL loop of examples/tinker_rl.py takes the warm start past 95% held-out."""

import contextlib
import hashlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from tinker import types  # noqa: E402

from tandem.errors import TandemError  # noqa: E402
from tandem.model.checkpoint import check_checkpoint  # noqa: E402
from tandem.runtime.startup import load_config  # noqa: E402
from tandem.serve.app import build_app, check_key  # noqa: E402
from tandem.serve.service import Service, open_service  # noqa: E402
from tandem.train.state import damaged_state  # noqa: E402

KEY = "tml-test"
MODEL = "builtin:addition"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The service in this process, on uvicorn in a thread, for the module's tests -> its URL and
    its `Service` (whose run.out_dir holds the checkpoints)."""
    cfg = load_config(None, [f"run.out_dir={tmp_path_factory.mktemp('serve')}", "run.name=serve"])
    service = open_service(cfg)
    with on_uvicorn(build_app(service)) as url:
        yield url, service


@contextlib.contextmanager
def on_uvicorn(app):
    """`app` answering on a free loopback port, on uvicorn in a thread, for the block -> its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def url(served) -> str:
    return served[0]


@contextlib.contextmanager
def client(url: str):
    """A ServiceClient whose session ends with the block (the service trains one model at a time)."""
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        yield service
    finally:
        service.close("success").result()


def answer_datum(tokenizer, question: str, answer: str) -> types.Datum:
    """An SFT datum: the chat prompt, then the answer and EOS, trained on the answer's tokens only."""
    chat = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = prompt + tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def carries(tokenizer) -> list[types.Datum]:
    """Problems with a carry, which the warm start gets wrong: their answers have a loss to lower."""
    return [
        answer_datum(tokenizer, f"{a}+{b}=", str(a + b)) for a, b in [(58, 67), (19, 23), (46, 38), (75, 99)]
    ]


def logprobs(training, data) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in training.forward(data, "cross_entropy").result().loss_fn_outputs]


def sft_step(training, data) -> float:
    backward = training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    return backward.result().metrics["loss:sum"]


def test_sft_steps_lower_the_loss(url):
    with client(url) as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
        assert training.get_info().lora_rank == 8
        data = carries(training.get_tokenizer())
        losses = [sft_step(training, data) for _ in range(6)]
        assert losses[-1] < 0.5 * losses[0], losses
        # forward: the same loss twice (no gradient, no step), per-target logprobs whose weighted sum is it
        first, again = (training.forward(data, "cross_entropy").result() for _ in range(2))
        assert first.metrics == again.metrics
        total = sum(
            -sum(
                lp * w
                for lp, w in zip(out["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist(), strict=True)
            )
            for out, d in zip(first.loss_fn_outputs, data, strict=True)
        )
        assert total == pytest.approx(first.metrics["loss:sum"], rel=1e-4)
        # the sampler serves what was trained: its prompt logprobs are the trainer's, within the
        # rounding of bf16 compute where the CPU has it (train.dtype=auto), on both sides
        sampler = training.save_weights_and_get_sampling_client().result()
        tokens = data[0].model_input.to_ints() + [data[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
        served = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert served[1:] == pytest.approx(first.loss_fn_outputs[0]["logprobs"].tolist(), abs=0.5)
        reply = sampler.sample(
            types.ModelInput.from_ints(tokens[:5]), 3, types.SamplingParams(max_tokens=4)
        ).result()
        assert len(reply.sequences) == 3 and all(
            len(s.tokens) == len(s.logprobs) <= 4 for s in reply.sequences
        )


def test_every_bad_request_gets_the_sdk_error_and_the_service_stays_up(url):
    with client(url) as service:
        with pytest.raises(tinker.BadRequestError, match="is not served here"):
            service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
        training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
        good = carries(training.get_tokenizer())[:1]
        tokens = good[0].model_input.to_ints()
        short = types.Datum(model_input=good[0].model_input, loss_fn_inputs={"target_tokens": tokens[1:]})
        with pytest.raises(tinker.BadRequestError, match="target_tokens"):
            training.forward_backward([short], "cross_entropy").result()
        with pytest.raises(tinker.BadRequestError, match="Unknown Tinker loss 'custom'"):
            training.forward_backward(good, "custom").result()
        with pytest.raises(
            tinker.BadRequestError, match=r"needs loss_fn_inputs \['logprobs', 'advantages'\]"
        ):
            training.forward_backward(good, "importance_sampling").result()
        with pytest.raises(tinker.NotFoundError, match="No sampler weights"):
            service.create_sampling_client(model_path="tinker://nobody/sampler_weights/nothing").result()
        with pytest.raises(tinker.NotFoundError, match="No checkpoint"):
            service.create_training_client_from_state("tinker://nobody/weights/nothing").result()
        # still serving, and the refused requests took no seq_id: the next ones run in order
        assert training.forward_backward(good, "cross_entropy").result().metrics["loss:sum"] > 0
        # a second model of another adapter shape while this one is live: refused, by name, saying
        # when a dead client's session (Ctrl-C: nobody can close it) frees itself
        shape = r"rank 8 on attention, MLP and the LM head.*rank 4 on attention, MLP and the LM head"
        shape += r" was asked for.*process has ended"
        with client(url) as other, pytest.raises(tinker.BadRequestError, match=shape + r".*within \d+ s"):
            other.create_lora_training_client(base_model=MODEL, rank=4).result()


WAIT_S = 60  # a request that takes longer is one the service lost (the old service's waited forever)


def test_a_name_that_cannot_be_a_directory_is_refused_and_the_next_requests_go_on(url):
    """Names are checked before they reach the file system: a 300-character one used to raise
    OSError in the path check (HTTP 500, retried), and its seq_id then held every later request."""
    with client(url) as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
        data = carries(training.get_tokenizer())[:1]
        for name in ["x" * 300, "../up", ".hidden", "a b"]:
            with pytest.raises(tinker.BadRequestError, match=r"must be 1 to 128 characters"):
                training.save_state(name).result(timeout=WAIT_S)
        with pytest.raises(tinker.BadRequestError, match=r"\(300 characters\)"):
            training.save_weights_for_sampler("y" * 300).result(timeout=WAIT_S)
        assert training.forward_backward(data, "cross_entropy").result(timeout=WAIT_S).metrics["loss:sum"] > 0
        assert training.save_state("fine-name_1.0").result(timeout=WAIT_S).path.endswith("/fine-name_1.0")


def test_an_unexpected_error_in_a_check_or_the_work_fails_that_request_only(url, monkeypatch):
    """Whatever a request's check or work raises (a bug; torch's CheckpointException, which is no
    Exception) becomes that request's error, and the model's next requests run."""
    from torch.distributed.checkpoint.api import CheckpointException

    with client(url) as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
        data = carries(training.get_tokenizer())[:1]

        def broken_check(data, vocab, context):
            raise RuntimeError("a bug in the check")

        with monkeypatch.context() as m:
            m.setattr("tandem.serve.service.check_tokens", broken_check)
            with pytest.raises(tinker.RequestFailedError, match="RuntimeError: a bug in the check"):
                training.forward_backward(data, "cross_entropy").result(timeout=WAIT_S)
        assert training.forward_backward(data, "cross_entropy").result(timeout=WAIT_S).metrics["loss:sum"] > 0

        real_call = Service._call

        async def failing_step(self, role, method, *args):
            if method == "optim_step":
                raise CheckpointException("optim_step", {0: (ValueError("a torch error"), None)})
            return await real_call(self, role, method, *args)

        with monkeypatch.context() as m:
            m.setattr(Service, "_call", failing_step)
            with pytest.raises(tinker.RequestFailedError, match="CheckpointException"):
                training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=WAIT_S)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=WAIT_S)
        assert training.forward(data, "cross_entropy").result(timeout=WAIT_S).metrics["loss:sum"] > 0


def test_a_tensor_whose_bytes_do_not_fill_its_shape_is_its_requests_error():
    """numpy's ValueError escaped the body's parse as an HTTP 500, before the request took its
    seq_id: every later request of the model waited for that seq_id. Now the check refuses it."""
    import numpy as np
    from tinker.proto import tinker_public_pb2 as pb

    from tandem.serve.wire import parse_forward_backward

    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=3, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([1, 2], dtype=np.int32).tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = pb.DTYPE_INT64, np.zeros(3, np.int64).tobytes()
    targets.shape.extend([5])
    request = parse_forward_backward(msg.SerializeToString())
    assert request.seq_id == 3 and "malformed loss_fn_inputs tensor" in request.error


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", -0.05),
        ("beta1", 1.0),
        ("beta2", -0.1),
        ("eps", 0.0),
        ("weight_decay", -0.01),
        ("grad_clip_norm", -1.0),
    ],
)
def test_adam_params_out_of_range_are_refused_by_name_and_take_no_step(url, field, value):
    """learning_rate=-0.05 used to take a step up the loss."""
    with client(url) as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8).result()
        data = carries(training.get_tokenizer())[:1]
        before = logprobs(training, data)
        training.forward_backward(data, "cross_entropy").result(timeout=WAIT_S)
        with pytest.raises(tinker.BadRequestError, match=rf"AdamParams\.{field}={value} must be"):
            training.optim_step(types.AdamParams(**{field: value})).result(timeout=WAIT_S)
        assert logprobs(training, data) == before


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_model_is_unchanged(served):
    """An optimizer shard cut short (a copy, a full disk): the load is refused before it touches the
    model (DCP's failure mid-load is a BaseException that used to end the trainer's call thread)."""
    url, live = served
    with client(url) as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result()
        data = carries(training.get_tokenizer())
        path = training.save_state("to-damage").result(timeout=WAIT_S).path
        sft_step(training, data)
        before = logprobs(training, data)
        (shard,) = Path(live.cfg.run.out_dir).rglob("to-damage/trainer/__0_0.distcp")
        shard.write_bytes(shard.read_bytes()[:1000])
        damaged = r"damaged.*__0_0\.distcp is truncated \(1000 of"
        for load in (training.load_state_with_optimizer, training.load_state):
            with pytest.raises(tinker.BadRequestError, match=damaged):
                load(path).result(timeout=WAIT_S)
        with pytest.raises(tinker.BadRequestError, match=r"damaged.*__0_0\.distcp is truncated"):
            service.create_training_client_from_state(path).result(timeout=WAIT_S)
        assert logprobs(training, data) == before


def test_a_crash_at_any_step_of_an_overwrite_leaves_the_old_or_the_new_checkpoint(tmp_path, monkeypatch):
    """Each file-system step of `commit` (fsync, rename, unlink, rmdir) in turn stops it, as a crash
    there would; `settle` then finds the old checkpoint or the new one, whole, and nothing beside it.
    (A crash while `.ckpt.new` is written leaves `ckpt` untouched.)"""
    from tandem.serve.checkpoints import aside, commit, settle

    class Crash(BaseException):
        pass

    def write(root: Path, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)

    def read(root: Path) -> dict[str, bytes]:
        return {str(f.relative_to(root)): f.read_bytes() for f in root.rglob("*") if f.is_file()}

    old = {"serve.json": b"old", "trainer/__0_0.distcp": b"o" * 4096, "model.safetensors": b"O" * 99}
    new = {"serve.json": b"new", "trainer/__0_0.distcp": b"n" * 4096, "model.safetensors": b"N" * 99}
    for crash_at in range(1000):
        where = tmp_path / str(crash_at) / "ckpt"
        write(where, old)
        write(aside(where, "new"), new)
        steps = 0

        def step(real, crash_at=crash_at):
            def crashing(*args, **kwargs):
                nonlocal steps
                steps += 1
                if steps > crash_at:
                    raise Crash
                return real(*args, **kwargs)

            return crashing

        with monkeypatch.context() as m:
            for name in ("rename", "unlink", "rmdir", "fsync"):
                m.setattr(os, name, step(getattr(os, name)))
            with contextlib.suppress(Crash):
                commit(aside(where, "new"), where)
        settle(where)
        assert read(where) in (old, new), crash_at
        assert [p.name for p in where.parent.iterdir()] == ["ckpt"], crash_at
        if steps <= crash_at:  # the commit ran to its end: every step before was a crash point
            break
    assert crash_at > 10 and read(where) == new


def test_a_key_is_required_off_loopback_and_checked_on_every_request():
    with pytest.raises(TandemError, match="needs|give it a key"):
        check_key("0.0.0.0", "")
    with pytest.raises(TandemError, match="tml-"):
        check_key("0.0.0.0", "secret")
    check_key("127.0.0.1", "")
    web = TestClient(build_app(service=None, api_key=KEY))  # the key is checked before any route runs
    assert web.get("/api/v1/healthz").status_code == 401
    assert web.get("/api/v1/healthz", headers={"X-API-Key": "tml-wrong"}).status_code == 401
    assert web.get("/api/v1/healthz", headers={"X-API-Key": KEY}).json() == {"status": "ok"}


def test_an_unexpected_error_of_a_route_is_a_500_that_names_it():
    """A bug in a route: its name and message, not a bare "Internal Server Error"."""
    web = TestClient(build_app(service=None), raise_server_exceptions=False)  # no service: a bug
    reply = web.get("/api/v1/get_server_capabilities")
    assert reply.status_code == 500 and reply.headers["x-should-retry"] == "false"
    assert "get_server_capabilities failed in the service: AttributeError" in reply.json()["detail"]


def start_service(out_dir: Path, *overrides: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tandem.cli.main",
        "serve",
        "--port",
        str(port),
        f"run.out_dir={out_dir}",
        *overrides,
    ]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/api/v1/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                return process, url
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.2)
    process.kill()
    raise AssertionError("tandem serve did not answer within 120 s")


@pytest.mark.integration
def test_a_killed_service_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
    """save_state, one more step, then kill -9; a new service loads the checkpoint with its optimizer
    and takes the same step: the weights after it give the same logprobs to the last bit."""
    first, url = start_service(tmp_path)
    try:
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=3).result()
        data = carries(training.get_tokenizer())
        for _ in range(2):
            sft_step(training, data)
        path = training.save_state("two-steps").result().path
        sft_step(training, data)
        expected = logprobs(training, data)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    second, url = start_service(tmp_path)
    try:
        with client(url) as service:
            training = service.create_training_client_from_state_with_optimizer(path).result()
            assert training.get_info().lora_rank == 8
            sft_step(training, data)
            got = logprobs(training, data)
            # the weights alone (Adam's moments afresh) take a different step: the optimizer mattered
            with pytest.warns(FutureWarning):
                training.load_state(path).result()
            sft_step(training, data)
            fresh = logprobs(training, data)
    finally:
        second.terminate()
        second.wait(30)
    assert got == expected
    assert fresh != expected


def checkpoint_files(out_dir: Path, path: str) -> tuple[Path, dict[str, str]]:
    """A save_state path's directory under the service's run.out_dir, and each file's sha256."""
    where = out_dir / "serve" / quote(path.split("/")[2], safe="") / "weights" / path.split("/")[-1]
    files = sorted(f for f in where.rglob("*") if f.is_file())
    return where, {str(f.relative_to(where)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def save_loop(url: str, out_dir: str, saves: int = 20) -> None:
    """The client of the kill test, in a process of its own (a killed service leaves the SDK
    retrying for minutes). Per save, as JSON lines: one SFT step and the model's logprobs, then
    save_state over one name and, once it is saved, its seconds and its files' hashes."""
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=5).result()
    data = carries(training.get_tokenizer())
    for i in range(saves):
        sft_step(training, data)
        print(json.dumps({"state": i, "logprobs": logprobs(training, data)}), flush=True)
        start = time.perf_counter()
        path = training.save_state("latest", overwrite=True).result().path
        seconds, (_, files) = time.perf_counter() - start, checkpoint_files(Path(out_dir), path)
        print(json.dumps({"saved": i, "path": path, "s": seconds, "files": files}), flush=True)


def kill_during_a_save(process: subprocess.Popen, url: str, out_dir: Path, rng: random.Random) -> dict:
    """`save_loop` against the service, which gets SIGKILL at a random moment of a random save after
    the first -> the loop's records: "path", "states" (logprobs), "files" (hashes of each save)."""
    kill_at, save_s = rng.randrange(1, 20), 0.2
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_serve_tinker as t; "
    code += f"t.save_loop({url!r}, {str(out_dir)!r})"
    loop = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    lines = []
    try:
        for line in loop.stdout:
            lines.append(line)
            record = json.loads(line) if line.startswith("{") else {}
            save_s = record.get("s", save_s)
            if record.get("state") == kill_at:
                time.sleep(rng.uniform(0, save_s))
                break
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
        loop.kill()
        lines += loop.stdout.read().splitlines()  # what it printed before the kill reached it
        loop.wait()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    states = [r["logprobs"] for r in records if "state" in r]
    assert len(states) > kill_at, "the save loop ended before the kill"
    saved = [r for r in records if "saved" in r]
    return {"path": saved[0]["path"], "states": states, "files": [r["files"] for r in saved]}


@pytest.mark.integration
def test_a_kill_during_an_overwriting_save_leaves_the_old_or_the_new_checkpoint_bit_for_bit(tmp_path):
    """20 save_state(overwrite=True) calls, SIGKILL at a random point of one, three times: a new
    service loads the checkpoint, with its optimizer, as the old one (every file as it was saved;
    its next step is the run's) or as the new one (the state being saved), every file whole and
    nothing beside it. The in-place save of old left serve.json beside cut-short shards."""
    rng = random.Random()
    process, url = start_service(tmp_path, "run.timeout_s=60")
    try:
        for _ in range(3):
            run = kill_during_a_save(process, url, tmp_path, rng)
            process, url = start_service(tmp_path, "run.timeout_s=60")
            last = len(run["states"]) - 1  # the kill came during save `last` or just after it
            with client(url) as service:
                training = service.create_training_client_from_state_with_optimizer(run["path"])
                training = training.result(WAIT_S)
                data = carries(training.get_tokenizer())
                got = logprobs(training, data)
                where, files = checkpoint_files(tmp_path, run["path"])
                if files == run["files"][last - 1]:  # the old checkpoint, untouched
                    assert got == run["states"][last - 1]
                    sft_step(training, data)
                    assert logprobs(training, data) == run["states"][last]
                else:  # the new one, whole
                    assert got == run["states"][last]
                    if len(run["files"]) > last:  # the loop saw it saved
                        assert files == run["files"][last]
            assert [p.name for p in where.parent.iterdir()] == ["latest"]
            assert damaged_state(where) == []
            check_checkpoint(where)
    finally:
        process.terminate()
        process.wait(30)


def test_the_example_without_a_held_out_set_prints_no_nan(url):
    env = {**os.environ, "TINKER_API_KEY": KEY}
    example = [sys.executable, str(ROOT / "examples" / "tinker_rl.py"), "--base-url", url, "--held-out", "0"]
    small = ["--steps", "1", "--batch", "2", "--group", "2"]
    out = subprocess.run(
        example + small, env=env, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert "nan" not in out.lower() and "1 steps in" in out, out


@pytest.mark.integration  # ~1-2 minutes: CI runs it (pytest's default selection leaves out only slow)
def test_the_sdk_rl_loop_takes_the_warm_start_past_95_percent(url):
    env = {**os.environ, "TINKER_API_KEY": KEY}
    example = [sys.executable, str(ROOT / "examples" / "tinker_rl.py"), "--base-url", url, "--steps", "30"]
    out = subprocess.run(example, env=env, capture_output=True, text=True, timeout=900, check=True).stdout
    before, after = map(
        float, re.search(r"held-out accuracy: ([\d.]+)% before -> ([\d.]+)% after", out).groups()
    )
    assert before < 60 and after >= 95, out


@pytest.mark.ray
def test_the_service_runs_its_workers_as_ray_actors_with_run_cluster_ray(tmp_path):
    """run.cluster=ray: the trainer and the engine are Ray actors placed as `tandem train` places
    its roles (so ray.address can put them on other machines); the SDK sees the same service."""
    process, url = start_service(tmp_path, "run.cluster=ray")
    try:
        with client(url) as service:
            training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
            data = carries(training.get_tokenizer())
            losses = [sft_step(training, data) for _ in range(4)]
            assert losses[-1] < losses[0], losses
            sampler = training.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(data[0].model_input.to_ints())
            reply = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4)).result()
            assert len(reply.sequences) == 2
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


# -- the SDK's other losses (their formulas: tests/test_serve_losses.py) -------------------------


def rl_datums(training, data: list[types.Datum], ratio_mask: bool) -> list[types.Datum]:
    """`data` as RL datums: the trainer's own logprobs as the sampler's, advantages +1 and -0.5 on
    the answers in turn (they do not cancel), and (`ratio_mask`) the answers as GSPO's ratio tokens."""
    out = []
    for i, (d, own) in enumerate(zip(data, logprobs(training, data), strict=True)):
        weights = d.loss_fn_inputs["weights"].tolist()
        inputs = {
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": own,
            "advantages": [(1.0 if i % 2 == 0 else -0.5) * w for w in weights],
        }
        if ratio_mask:
            inputs["sequence_ratio_mask"] = weights
        out.append(types.Datum(model_input=d.model_input, loss_fn_inputs=inputs))
    return out


@pytest.mark.parametrize(
    "loss, config, bad, refusal",
    [
        ("dro", {"beta": 0.05}, {}, r"Loss 'dro' needs loss_fn_config\['beta'\]"),
        (
            "gspo",
            {},
            {"clip_high_threshold": 0.5},
            r"loss_fn_config\['clip_high_threshold'\]=0.5 of loss 'gspo'",
        ),
        ("cispo", {}, {"clip_low_threshold": -1.0}, r"loss_fn_config\['clip_low_threshold'\]=-1.0 of loss"),
    ],
)
def test_every_loss_the_sdk_names_gives_a_finite_loss_and_a_step(url, loss, config, bad, refusal):
    import math

    with client(url) as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
        data = carries(training.get_tokenizer())
        rl = rl_datums(training, data, ratio_mask=loss == "gspo")
        before = logprobs(training, data)
        result = training.forward_backward(rl, loss, config).result(timeout=WAIT_S)
        assert math.isfinite(result.metrics["loss:sum"]) and result.metrics["loss:sum"] != 0
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=WAIT_S)
        assert logprobs(training, data) != before  # the step moved the weights
        with pytest.raises(tinker.BadRequestError, match=refusal):
            training.forward_backward(rl, loss, bad).result(timeout=WAIT_S)


def test_stable_reinforce_trains_on_recorded_samples_and_refuses_a_sequence_never_recorded(url):
    import math

    with client(url) as service:
        training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
        prompt = carries(training.get_tokenizer())[0].model_input.to_ints()[:-2]
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        reply = sampler.sample(
            types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4)
        ).result()
        data = []
        for i, s in enumerate(reply.sequences):
            full, pad = prompt + list(s.tokens), [0.0] * (len(prompt) - 1)
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": full[1:],
                    "logprobs": pad + list(s.logprobs),
                    "advantages": pad + [1.0 if i == 0 else -1.0] * len(s.tokens),
                },
            )
            sid = s.sequence_id
            data.append(
                datum.with_provenance(
                    model_input=[
                        types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(s.tokens) - 1),
                    ],
                    loss_fn_inputs=[
                        types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(s.tokens)),
                    ],
                )
            )
        result = training.forward_backward(data, "stable_reinforce", {"kl_coeff": 0.1}).result(timeout=WAIT_S)
        assert math.isfinite(result.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=WAIT_S)
        forged = data[0].with_provenance(
            model_input=data[0].model_input_spans,
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id="req-0:7", offset=1, length=len(prompt) - 1),
                types.SampledProvenanceSpan(sequence_id="req-0:7", length=len(reply.sequences[0].tokens)),
            ],
        )
        with pytest.raises(tinker.BadRequestError, match="'req-0:7', which this session never recorded"):
            training.forward_backward([forged], "stable_reinforce").result(timeout=WAIT_S)


def test_forward_backward_custom_as_the_sdk_drives_it(url):
    """The SDK's own custom loss: a forward, the loss and its gradient on the client, then a
    cross_entropy forward_backward weighted by that gradient, under request ids it reserved. Its
    gradient must be the custom loss's: -sum(logp) written as a custom loss gives the step
    cross_entropy with weights 1 gives (the same model, seed and data)."""
    import torch

    def steps(custom: bool) -> list[list[float]]:
        with client(url) as service:
            training = service.create_lora_training_client(base_model=MODEL, rank=8, seed=4).result()
            data = carries(training.get_tokenizer())
            if custom:

                def loss(data, logprobs):
                    total = -sum(lp.sum() for lp in logprobs)
                    return total, {"custom:sum": float(total)}

                result = training.forward_backward_custom(data, loss).result(timeout=WAIT_S)
                assert result.metrics["custom:sum"] > 0
            else:
                ones = [
                    types.Datum(
                        model_input=d.model_input,
                        loss_fn_inputs={
                            "target_tokens": d.loss_fn_inputs["target_tokens"],
                            "weights": torch.ones(len(d.loss_fn_inputs["target_tokens"].tolist())),
                        },
                    )
                    for d in data
                ]
                training.forward_backward(ones, "cross_entropy").result(timeout=WAIT_S)
            training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=WAIT_S)
            return logprobs(training, data)

    custom, plain = steps(True), steps(False)
    for mine, theirs in zip(custom, plain, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
