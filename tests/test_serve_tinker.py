"""`tandem serve` driven by the official `tinker` SDK: SFT lowers the loss, bad requests get the SDK's
errors and leave the service up, a checkpoint survives a killed service bit for bit, and
(integration) the SDK-style RL loop of examples/tinker_rl.py takes the warm start past 95% held-out."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from tinker import types  # noqa: E402

from tandem.errors import TandemError  # noqa: E402
from tandem.runtime.startup import load_config  # noqa: E402
from tandem.serve.app import build_app, check_key  # noqa: E402
from tandem.serve.service import Service  # noqa: E402
from tandem.serve.workers import resolve, start_workers  # noqa: E402

KEY = "tml-test"
MODEL = "builtin:addition"
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The service in this process, on uvicorn in a thread, for the module's tests."""
    cfg = resolve(load_config(None, [f"run.out_dir={tmp_path_factory.mktemp('serve')}", "run.name=serve"]))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(Service(cfg, start_workers(cfg))), "127.0.0.1", port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


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
        with pytest.raises(tinker.BadRequestError, match="Unknown Tinker loss 'dro'"):
            training.forward_backward(good, "dro").result()
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
        # a second model while this one is live: refused, by name
        with client(url) as other, pytest.raises(tinker.BadRequestError, match="one model at a time"):
            other.create_lora_training_client(base_model=MODEL, rank=8).result()


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
