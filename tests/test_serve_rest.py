"""`tandem serve`'s REST side through the real SDK's `RestClient`: the round trip train -> save
(ttl, user_metadata) -> list runs and checkpoints -> download the archive -> `peft` and
`transformers` load it, with the trainer's logprobs -> delete -> gone; ttl expiry; refusals by name;
and the tokenizer for a client on another machine (`tandem/serve/hub.py`)."""

import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
pytest.importorskip("peft")
import httpx  # noqa: E402
import torch  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from test_serve_tinker import KEY, MODEL, WAIT_S, carries, client, on_uvicorn  # noqa: E402
from tinker import types  # noqa: E402

from tandem.model.config import resolve_model_path  # noqa: E402
from tandem.runtime.startup import load_config  # noqa: E402
from tandem.serve.app import build_app  # noqa: E402
from tandem.serve.service import Service, open_service  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration  # a service of its own, transformers and peft loads: seconds each


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The service in this process (fp32, so that transformers' fp32 forward matches the trainer's
    closely) -> its URL and its `Service`."""
    out = tmp_path_factory.mktemp("serve")
    cfg = load_config(
        None, [f"run.out_dir={out}", "run.name=serve", "train.dtype=float32", "rollout.dtype=float32"]
    )
    service = open_service(cfg)
    with on_uvicorn(build_app(service)) as url:
        yield url, service


def trained(service_client, **metadata) -> tuple:
    """A LoRA model one SFT step from the base -> (its training client, its data)."""
    training = service_client.create_lora_training_client(
        base_model=MODEL, rank=8, seed=1, user_metadata=metadata or None
    ).result(timeout=WAIT_S)
    data = carries(training.get_tokenizer())
    training.forward_backward(data, "cross_entropy").result(timeout=WAIT_S)
    training.optim_step(types.AdamParams(learning_rate=3e-3)).result(timeout=WAIT_S)
    return training, data


def trainer_logprobs(training, data) -> list[torch.Tensor]:
    out = training.forward(data, "cross_entropy").result(timeout=WAIT_S).loss_fn_outputs
    return [torch.tensor(o["logprobs"].tolist()) for o in out]


def hf_logprobs(model, data) -> list[torch.Tensor]:
    """Each datum's target logprobs under a transformers (or PEFT) model."""
    found = []
    with torch.no_grad():
        for d in data:
            tokens = torch.tensor([d.model_input.to_ints()])
            logp = model(tokens).logits.float().log_softmax(-1)[0]  # (T, V)
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
            found.append(logp.gather(-1, targets[:, None])[:, 0])
    return found


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=0)


def fetch(url: str, into: Path) -> Path:
    """An archive downloaded as the cookbook's `weights.download` does it (urllib, no API key) and
    extracted into `into`, refused as it refuses one with links or paths out of it."""
    into.mkdir(parents=True)
    urllib.request.urlretrieve(url, into / "archive.tar")
    with tarfile.open(into / "archive.tar") as tar:
        assert not [m for m in tar.getmembers() if m.issym() or m.islnk() or ".." in m.name]
        tar.extractall(into, filter="data")
    (into / "archive.tar").unlink()
    return into


def archive_url(url: str, tinker_path: str) -> str:
    """GET .../archive as the SDK before 0.38 sends it (get_checkpoint_archive_url): its JSON answer."""
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    where = f"{url}/api/v1/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}/archive"
    answer = httpx.get(where, headers={"X-API-Key": KEY}, follow_redirects=False)
    assert answer.status_code == 200, answer.text
    return answer.json()["url"]


def test_train_save_list_download_load_delete(served, tmp_path):
    url, _ = served
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with client(url) as service_client:
        training, data = trained(service_client, renderer_name="role_colon")
        want = trainer_logprobs(training, data)
        saved = training.save_state("step-1", ttl_seconds=3600, user_metadata={"step": "1"})
        saved = saved.result(timeout=WAIT_S)
        sampler = training.save_weights_for_sampler("sampler-1", user_metadata={"kind": "eval"})
        sampler = sampler.result(timeout=WAIT_S)
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        run_id = training.get_info().model_id

        # the run, by id and by a checkpoint's path: the renderer name the cookbook stores is there
        run = rest.get_training_run_by_tinker_path(saved.path).result()
        assert (run.training_run_id, run.base_model, run.is_lora, run.lora_rank) == (run_id, MODEL, True, 8)
        assert run.user_metadata == {"renderer_name": "role_colon"}
        assert run.last_checkpoint.tinker_path == saved.path
        assert run.last_sampler_checkpoint.tinker_path == sampler.path
        assert run_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        assert run_id in rest.get_session(run.model_owner).result().training_run_ids
        assert run.model_owner in rest.list_sessions().result().sessions

        listed = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert set(listed) == {saved.path, sampler.path}
        state = listed[saved.path]
        assert (state.checkpoint_type, state.checkpoint_id) == ("training", "weights/step-1")
        assert state.user_metadata == {"step": "1"} and state.size_bytes > 0 and not state.public
        assert 3599 < (state.expires_at - state.time).total_seconds() < 3601
        assert listed[sampler.path].checkpoint_type == "sampler" and listed[sampler.path].expires_at is None
        everyone = rest.list_user_checkpoints().result()
        assert {saved.path, sampler.path} <= {c.tinker_path for c in everyone.checkpoints}
        assert everyone.cursor.total_count >= 2
        info = rest.get_weights_info_by_tinker_path(saved.path).result()
        assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp) == (MODEL, True, 8, True)
        assert info.train_unembed  # the SDK's default: the LM head has an adapter too

        # the archive (tar, as Tinker's): the PEFT adapter naming the served base, the tokenizer
        link = archive_url(url, saved.path)
        adapter = fetch(link, tmp_path / "adapter")
        assert {"adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"} <= {
            p.name for p in adapter.iterdir()
        }
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == MODEL and "lm_head" in config["target_modules"]
        base_dir = resolve_model_path(MODEL)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        assert_close(hf_logprobs(PeftModel.from_pretrained(base, adapter), data), want)
        # ... and merged: the same URL's merged.tar, which transformers loads alone
        merged = fetch(link.replace("/archive.tar?", "/merged.tar?"), tmp_path / "merged")
        assert_close(
            hf_logprobs(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), data), want
        )
        tokenizer = AutoTokenizer.from_pretrained(merged)
        assert tokenizer.encode("12+34=") == training.get_tokenizer().encode("12+34=")
        # a sampler checkpoint's archive: its snapshot as a PEFT adapter
        sampled = fetch(archive_url(url, sampler.path), tmp_path / "sampler")
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        assert_close(hf_logprobs(PeftModel.from_pretrained(base, sampled), data), want)

        # the 0.38 SDK's way: save_weights_external, then a signed URL per file
        external = training.save_weights_external("export", ttl_seconds=3600).result(timeout=WAIT_S)
        urls = rest.get_external_weights_urls(external.path).result()
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(urls.urls)
        for name, file_url in urls.urls.items():  # as `tinker checkpoint download` fetches them
            (tmp_path / "external" / name).parent.mkdir(parents=True, exist_ok=True)
            urllib.request.urlretrieve(file_url, tmp_path / "external" / name)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        assert_close(hf_logprobs(PeftModel.from_pretrained(base, tmp_path / "external"), data), want)
        assert "external" in {c.checkpoint_type for c in rest.list_checkpoints(run_id).result().checkpoints}

        # delete: gone from the listing, its load and its archive are 404s, and so is a second delete
        rest.delete_checkpoint_from_tinker_path(saved.path).result()
        rest.delete_checkpoint(run_id, "sampler_weights/sampler-1").result()
        left = {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert left == {external.path}
        with pytest.raises(tinker.NotFoundError, match="No checkpoint"):
            rest.delete_checkpoint_from_tinker_path(saved.path).result()
        with pytest.raises(tinker.NotFoundError, match="No checkpoint"):
            service_client.create_training_client_from_state(saved.path).result(timeout=WAIT_S)
        with pytest.raises(tinker.NotFoundError, match="No sampler weights"):
            service_client.create_sampling_client(model_path=sampler.path).result(timeout=WAIT_S)
        assert urllib_status(link) == 404


def test_the_cookbook_reads_its_renderer_and_downloads_a_training_checkpoint(served, monkeypatch, tmp_path):
    """tinker-cookbook's own calls: the renderer name it stores in the run's metadata, and
    `weights.download` of a save_state checkpoint (a new model from it, save_weights_external
    encrypted to a key it draws, each file fetched, decrypted, and the export deleted)."""
    cookbook = pytest.importorskip("tinker_cookbook")
    pytest.importorskip("pyrage")
    from peft import PeftModel
    from tinker_cookbook import checkpoint_utils, weights
    from transformers import AutoModelForCausalLM

    url, _ = served
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    with client(url) as service_client:
        training, data = trained(service_client, renderer_name="role_colon")
        want = trainer_logprobs(training, data)
        saved = training.save_state("for-cookbook").result(timeout=WAIT_S)
        assert checkpoint_utils.get_renderer_name_from_checkpoint(service_client, saved.path) == "role_colon"
        out = weights.download(tinker_path=saved.path, output_dir=str(tmp_path / "cookbook"), base_url=url)
        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(MODEL), dtype=torch.float32)
        assert_close(hf_logprobs(PeftModel.from_pretrained(base, out), data), want)
        # the run it exported through, with the metadata it gave, holds no export any more
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        made = {"created_by": "tinker_cookbook.weights.download"}
        runs = [r for r in rest.list_training_runs().result().training_runs if r.user_metadata == made]
        assert len(runs) == 1, f"cookbook {cookbook.__version__}"
        assert rest.list_checkpoints(runs[0].training_run_id).result().checkpoints == []


def urllib_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url):
            return 200
    except urllib.error.HTTPError as e:
        return e.code


def test_a_checkpoint_past_its_ttl_is_gone_when_next_looked_at(served):
    url, service = served
    with client(url) as service_client:
        training, _ = trained(service_client)
        run_id = training.get_info().model_id
        short = training.save_state("short", ttl_seconds=1).result(timeout=WAIT_S)
        sampler = training.save_weights_for_sampler("short-sampler", ttl_seconds=1).result(timeout=WAIT_S)
        kept = training.save_state("kept").result(timeout=WAIT_S)
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        where = service.checkpoints.parse(short.path)
        assert where.is_dir()
        # a ttl set afterwards, then taken off again: the checkpoint stays
        rest.set_checkpoint_ttl_from_tinker_path(kept.path, 3600).result()
        expiring = {c.tinker_path: c.expires_at for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert expiring[kept.path] is not None
        rest.set_checkpoint_ttl_from_tinker_path(kept.path, None).result()
        with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds=0 must be from 1"):
            rest.set_checkpoint_ttl_from_tinker_path(kept.path, 0).result()
        with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds=-5 must be from 1"):
            training.save_state("never", ttl_seconds=-5).result(timeout=WAIT_S)
        time.sleep(1.2)
        listed = {c.tinker_path: c for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert set(listed) == {kept.path} and listed[kept.path].expires_at is None
        assert not where.exists()  # deleted on disk as the listing looked
        with pytest.raises(tinker.NotFoundError, match="No sampler weights"):
            service_client.create_sampling_client(model_path=sampler.path).result(timeout=WAIT_S)
        with pytest.raises(tinker.NotFoundError, match="No checkpoint"):
            training.load_state(short.path).result(timeout=WAIT_S)
        # the name is free again
        assert training.save_state("short").result(timeout=WAIT_S).path == short.path


def test_bad_paths_and_missing_checkpoints_are_refused_by_name(served):
    url, _ = served
    with client(url) as service_client:
        training, _ = trained(service_client)
        run_id = training.get_info().model_id
        saved = training.save_state("here").result(timeout=WAIT_S)
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        with pytest.raises(
            tinker.BadRequestError, match=r"is not a checkpoint path: tinker://<model_id>/<kind>/<name>"
        ):
            rest.get_weights_info_by_tinker_path("tinker://x/bogus/y").result()
        with pytest.raises(tinker.BadRequestError, match=r"Checkpoint kind 'bogus' is not one of weights"):
            rest.delete_checkpoint(run_id, "bogus/here").result()
        with pytest.raises(tinker.BadRequestError, match=r"Checkpoint name '\.hidden' must be 1 to 128"):
            rest.delete_checkpoint(run_id, "weights/.hidden").result()
        with pytest.raises(tinker.BadRequestError, match="is not one the service makes"):
            rest.get_training_run("a b").result()
        with pytest.raises(tinker.NotFoundError, match="No training run 'nobody:train:0'"):
            rest.get_training_run("nobody:train:0").result()
        with pytest.raises(tinker.NotFoundError, match="No checkpoint at 'tinker://.*/weights/missing'"):
            rest.delete_checkpoint(run_id, "weights/missing").result()
        with pytest.raises(tinker.NotFoundError, match="No checkpoint"):
            rest.publish_checkpoint_from_tinker_path(saved.path.replace("here", "gone")).result()
        rest.publish_checkpoint_from_tinker_path(saved.path).result()
        assert [c.public for c in rest.list_checkpoints(run_id).result().checkpoints] == [True]
        with pytest.raises(tinker.BadRequestError, match="is public already"):
            rest.publish_checkpoint_from_tinker_path(saved.path).result()
        rest.unpublish_checkpoint_from_tinker_path(saved.path).result()
        with pytest.raises(
            tinker.BadRequestError, match="copy_weights is not served: tandem serve has no projects"
        ):
            rest.copy_weights(saved.path, "somewhere").result()
        # refused in the request's turn: its seq_id is used, and the next request runs
        with pytest.raises(tinker.BadRequestError, match=r"'nope' is not an age1\.\.\. or SSH public key"):
            training.save_weights_external("sealed", age_encryption_recipients=["nope"]).result(
                timeout=WAIT_S
            )
        assert training.save_state("after").result(timeout=WAIT_S).path.endswith("/after")
        # a download URL whose signature is not the service's
        bad = archive_url(url, saved.path).replace("signature=", "signature=0")
        assert urllib_status(bad) == 404


def test_a_checkpoint_a_save_is_writing_is_not_deleted(served, monkeypatch):
    url, _ = served
    real_call, writing, release = Service._call, threading.Event(), threading.Event()

    async def slow_save(self, role, method, *args):
        if method == "save_model":
            writing.set()
            await __import__("asyncio").to_thread(release.wait, WAIT_S)
        return await real_call(self, role, method, *args)

    with client(url) as service_client:
        training, _ = trained(service_client)
        rest = tinker.RestClient(base_url=url, api_key=KEY)
        first = training.save_state("busy").result(timeout=WAIT_S)
        monkeypatch.setattr(Service, "_call", slow_save)
        again = training.save_state("busy", overwrite=True)
        assert writing.wait(WAIT_S)
        with pytest.raises(tinker.BadRequestError, match="is being written by a save in flight"):
            rest.delete_checkpoint_from_tinker_path(first.path).result()
        release.set()
        assert again.result(timeout=WAIT_S).path == first.path
        rest.delete_checkpoint_from_tinker_path(first.path).result()


def test_a_keyed_service_lets_signed_downloads_and_its_bearer_key_through_and_nothing_else():
    """Download URLs carry their own signature (a plain GET, as urllib makes it); huggingface_hub
    sends HF_TOKEN as a Bearer token: either passes the key check, and nothing else does."""
    web = TestClient(build_app(service=None, api_key=KEY))  # the key is checked before any route runs
    assert web.get("/api/v1/training_runs").status_code == 401
    assert web.get("/api/v1/training_runs", headers={"authorization": "Bearer tml-wrong"}).status_code == 401
    refused = web.get("/api/v1/download/a:train:0/weights/x/archive.tar?expires=9999999999&signature=00")
    assert (
        refused.status_code == 404 and "not valid" in refused.json()["detail"]
    )  # the signature, not the key


REMOTE = """
import json, sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-test")
training = service.create_lora_training_client(base_model="builtin:addition", rank=8)
sampler = service.create_sampling_client(base_model="builtin:addition")
print(json.dumps({
    "tokenizer_id": training.get_info().model_data.tokenizer_id,
    "training": training.get_tokenizer().encode("12+34="),
    "sampling": sampler.get_tokenizer().encode("12+34="),
}))
service.close("success").result()
"""


def test_a_client_on_another_machine_gets_the_tokenizer_from_the_service(served, monkeypatch, tmp_path):
    """The SDK's get_tokenizer loads `tokenizer_id` with transformers. A client that reaches the
    service from another machine is given a hub repository id, which it loads from the service
    (HF_ENDPOINT), with no network and none of the service's files."""
    url, _ = served
    with client(url) as service_client:  # this machine: the directory
        training = service_client.create_lora_training_client(base_model=MODEL, rank=8).result(timeout=WAIT_S)
        local = training.get_info().model_data.tokenizer_id
        assert Path(local).is_dir()
        want = training.get_tokenizer().encode("12+34=")
    monkeypatch.setattr("tandem.serve.hub.on_this_machine", lambda host: False)  # as if from elsewhere
    env = {
        **os.environ,
        "HF_ENDPOINT": f"{url}/api/v1/hf",
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run(
        [sys.executable, "-c", REMOTE, url], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    remote = json.loads(done.stdout.strip().splitlines()[-1])
    assert remote["tokenizer_id"] == "tandem-serve/builtin-addition"
    assert remote["training"] == want and remote["sampling"] == want
