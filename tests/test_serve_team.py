"""Several clients on one `tandem serve`, through the official `tinker` SDK: each trains its own
LoRA adapter with its own AdamW state on the one base; their requests interleave; every sampler
they saved still samples; with run.deterministic=true each sampled row's logprobs equal its own
trainer's bit for bit, however the adapters mix; a client that died does not block the next."""

import os
import signal
import subprocess
import sys
import time

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import torch  # noqa: E402
from test_serve_tinker import KEY, MODEL, WAIT_S, carries, logprobs, on_uvicorn  # noqa: E402
from tinker import types  # noqa: E402

from tandem.runtime.startup import load_config  # noqa: E402
from tandem.serve import sampling  # noqa: E402
from tandem.serve.app import build_app  # noqa: E402
from tandem.serve.service import open_service  # noqa: E402
from tandem.serve.snapshots import Snapshots  # noqa: E402


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    """A service in run.deterministic mode: the engine scores as the trainer does."""
    out = f"run.out_dir={tmp_path_factory.mktemp('serve')}"
    cfg = load_config(None, [out, "run.name=serve", "run.deterministic=true"])
    service = open_service(cfg)
    with on_uvicorn(build_app(service)) as url:
        yield url, service


def sft_steps(training, data, steps: int) -> None:
    for _ in range(steps):
        training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=3e-3)).result(timeout=WAIT_S)


@pytest.mark.integration
def test_two_clients_train_their_own_adapters_as_each_would_alone(exact):
    """Interleaved step by step, each client's model ends where the same loop alone ends, bit for
    bit: its adapters, gradients and AdamW moments are its own."""
    url, _ = exact
    alone = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        solo = alone.create_lora_training_client(base_model=MODEL, rank=8, seed=11).result()
        data = carries(solo.get_tokenizer())
        sft_steps(solo, data, 3)
        expected = logprobs(solo, data)
    finally:
        alone.close("success").result()
    one, two = (tinker.ServiceClient(base_url=url, api_key=KEY) for _ in range(2))
    try:
        a = one.create_lora_training_client(base_model=MODEL, rank=8, seed=11).result()
        b = two.create_lora_training_client(base_model=MODEL, rank=8, seed=12).result()
        other = list(reversed(data))
        for _ in range(3):  # b's requests between a's: a's gradient must not take b's
            a.forward_backward(data, "cross_entropy")
            b.forward_backward(other, "cross_entropy")
            b.optim_step(types.AdamParams(learning_rate=1e-2))
            a.optim_step(types.AdamParams(learning_rate=3e-3)).result(timeout=WAIT_S)
        assert logprobs(a, data) == expected
        assert logprobs(b, data) != expected
    finally:
        one.close("success").result()
        two.close("success").result()


@pytest.mark.integration
def test_samplers_of_several_clients_and_versions_sample_together_each_exactly_its_own(exact, monkeypatch):
    """Four clients' samplers, an older sampler of the first and the base sample in one burst, as
    ONE engine call over rows of their adapters; each sampled token's logprob equals what its own
    trainer computes for it, bit for bit (run.deterministic): the sampler–trainer gap is exactly 0
    with adapters mixed in a call (TuFT measured 0.114 there)."""
    url, service = exact
    monkeypatch.setattr(sampling, "GATHER_S", 2.0)  # the burst's requests surely arrive together
    clients = [tinker.ServiceClient(base_url=url, api_key=KEY) for _ in range(4)]
    try:
        models = [
            c.create_lora_training_client(base_model=MODEL, rank=8, seed=20 + i).result()
            for i, c in enumerate(clients)
        ]
        data = carries(models[0].get_tokenizer())
        older = models[0].save_weights_and_get_sampling_client().result()
        for i, m in enumerate(models):
            sft_steps(m, data[i : i + 2], 1 + i)
        samplers = [m.save_weights_and_get_sampling_client().result() for m in models]
        base = clients[0].create_sampling_client(base_model=MODEL).result(timeout=WAIT_S)
        prompt = data[0].model_input.to_ints()[:-3]
        asks = [(s, m) for s, m in zip(samplers, models, strict=True)] + [(older, None), (base, None)]
        calls = service.counts.get("rollout.sample", 0)
        futures = [
            s.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, seed=5))
            for s, _ in asks
        ]
        replies = [f.result(timeout=WAIT_S) for f in futures]
        assert service.counts["rollout.sample"] == calls + 1  # one generate call for all six samplers
        for (_, model), reply in zip(asks[:4], replies[:4], strict=True):
            for seq in reply.sequences:
                full = prompt + list(seq.tokens)
                datum = types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:]},
                )
                trained = model.forward([datum], "cross_entropy").result(timeout=WAIT_S)
                theirs = trained.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]
                assert list(seq.logprobs) == theirs  # bit for bit
        assert len(replies[4].sequences) == 2  # the oldest sampler still samples
        assert len(replies[5].sequences) == 2  # and the base, rows of no adapter
    finally:
        for c in clients:
            c.close("success").result()


@pytest.mark.integration
def test_a_client_that_died_does_not_block_the_next(exact, tmp_path):
    """A client killed (SIGKILL: no close, no more heartbeats) while its model is live: the next
    client's model is made at once, not 60 s later."""
    url, _ = exact
    script = (
        "import os, sys, tinker\n"
        "os.environ.setdefault('TINKER_TELEMETRY', '0')\n"
        f"c = tinker.ServiceClient(base_url={url!r}, api_key={KEY!r})\n"
        f"c.create_lora_training_client(base_model={MODEL!r}, rank=8).result()\n"
        "print('made', flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "made"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        start = time.monotonic()
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        try:
            training = service.create_lora_training_client(base_model=MODEL, rank=8).result(timeout=WAIT_S)
            data = carries(training.get_tokenizer())[:1]
            assert training.forward(data, "cross_entropy").result(timeout=WAIT_S).metrics["loss:sum"] > 0
        finally:
            service.close("success").result()
        assert time.monotonic() - start < 30
    finally:
        if child.poll() is None:
            child.kill()


def test_samplers_past_the_resident_ones_are_read_back_from_disk(tmp_path):
    snapshots = Snapshots(tmp_path, resident=1)
    first = {"w": torch.arange(4, dtype=torch.bfloat16)}
    snapshots.put("one", first, 1)
    snapshots.put("two", {"w": torch.zeros(4, dtype=torch.bfloat16)}, 1)
    assert list(snapshots.memory) == ["two"] and len(list(tmp_path.iterdir())) == 1
    assert torch.equal(snapshots.get("one")["w"], first["w"]) and "one" in snapshots


@pytest.mark.integration
def test_each_full_weights_model_starts_from_the_base(tmp_path_factory):
    """--full-weights trains the base itself: the next model (after the last one closed) starts
    from the base again, not from where its predecessor left it."""
    cfg = load_config(None, [f"run.out_dir={tmp_path_factory.mktemp('serve')}", "run.name=serve"])
    service = open_service(cfg, full_weights=True)
    with on_uvicorn(build_app(service)) as url:
        seen = []
        for steps in (2, 0):
            client = tinker.ServiceClient(base_url=url, api_key=KEY)
            try:
                training = client.create_lora_training_client(base_model=MODEL, rank=8).result()
                data = carries(training.get_tokenizer())
                seen.append(logprobs(training, data))
                sft_steps(training, data, steps)
            finally:
                client.close("success").result()
        assert seen[1] == seen[0]
