"""What delta pushes (`sync.delta=true`) send, in bytes: bench/weight_sync.py's byte figures.

No Ray and no timed transport here, only what the encoder emits, in this process:

- `default_run_ratio`: the default run (`tandem train` with no overrides), step by step as its loop
  runs it: the rollout worker generates each batch on the last pushed weights, the reward function
  scores it, the trainer steps, and the trainer's object store transport (delta on) pushes to the
  rollout worker's staging buffer, swapped in before the next batch. -> delta / full bytes per
  push, over the pushes after the first (which has nothing to diff against, so it is full).
- `qwen_ratios`: the Qwen2-0.5B-shaped random model of bench/engine.py after one optimizer step at
  lr 1e-6, bf16 compute and bf16 pushes; block-sparse (tandem's encoding) against the alternatives
  it was chosen over: int32 index + value, and the XOR of the two versions compressed by zlib.
"""

import statistics
import time
import zlib
from dataclasses import replace

import numpy as np
import torch

from tandem import devices
from tandem.config import AlgoConfig, TrainConfig
from tandem.config.sampling import sampling_params
from tandem.dtypes import DTYPES
from tandem.model.decoder import CausalLM, init_weights
from tandem.reward.user_fn import load_reward_fn
from tandem.rollout.group import make_groups
from tandem.runtime.roles import build_data, build_rollout, build_trainer, load_checked_tokenizer
from tandem.runtime.startup import load_config
from tandem.sample import Prompt, Sample, Status
from tandem.sync import BucketPlan, DeltaEncoder, ObjectStoreTransport, StagingBuffer, pack_bucket
from tandem.sync.delta import element_size, elements
from tandem.sync.plan import HEADER_BYTES
from tandem.train.worker import TrainWorker


def default_run_ratio(overrides: list[str], steps: int) -> float:
    """Mean delta / full bytes of the default run's pushes after steps 1..`steps` (see above)."""
    cfg = devices.resolve(load_config(None, overrides), 0)
    data, tokenizer = build_data(cfg), load_checked_tokenizer(cfg)
    trainer, (rollout, _) = build_trainer(cfg, tokenizer), build_rollout(cfg)
    params = rollout.engine.named_weights()
    s = cfg.sync
    plan = BucketPlan.from_named_tensors(
        trainer.pushed_weights(), s.produce_bucket_mb, s.consume_bucket_mb, DTYPES[cfg.rollout.dtype]
    )
    sender, receiver = (
        ObjectStoreTransport(plan, "train/0", delta=True),
        ObjectStoreTransport(plan, "rollout/0"),
    )
    staging, reward = StagingBuffer(plan), load_reward_fn(cfg.reward.fn)
    ratios = []
    for step in range(steps + 1):
        if step:  # step 0 is the push before anything generates
            prompts, ids = data.train.next_batch(cfg.rollout.batch_size)
            samples = rollout.generate(
                make_groups(prompts, ids, cfg.rollout.n), sampling_params(cfg, cfg.rollout.temperature)
            )
            for sample in samples:
                sample.reward, sample.reward_parts = reward(sample.prompt, sample.response_text)
            trainer.train_step(samples)
        version = trainer.version
        receiver.receive(sender.send(trainer.pushed_weights(), version), version, staging, timeout_s=60)
        rollout.set_pending_update(version, lambda v=version: staging.swap_into(params, v))
        if step:
            ratios.append(sender.sent_bytes / sum(plan.bucket_nbytes))
    return statistics.mean(ratios)


def qwen_ratios(model_cfg, layers: int | None, produce_mb: float) -> dict[str, float]:
    """The Qwen2-0.5B-shaped model before and after one AdamW step at lr 1e-6 (bf16 compute, fp32
    masters), pushed in bf16 -> each encoding's bytes over the full push's, and its encode speed
    (bytes of bucket per second, one core)."""
    if layers is not None:
        model_cfg = replace(model_cfg, num_hidden_layers=layers)
    model = CausalLM(model_cfg)
    init_weights(model, seed=0)
    plan = BucketPlan.from_named_tensors(model.named_parameters(), produce_mb, 0, torch.bfloat16)
    before = [packed(plan, model, i, 0) for i in range(plan.num_buckets)]
    encoder = DeltaEncoder(plan)
    for bucket in before:
        encoder.encode(bucket, encoder.begin())
    encoder.end(0)
    one_step(model, model_cfg.pad_token_id, model_cfg.vocab_size)
    sizes = {"block_sparse": 0, "index32": 0, "xor_zlib": 0}
    seconds = dict.fromkeys(sizes, 0.0)
    base = encoder.begin()
    for i in range(plan.num_buckets):
        after = packed(plan, model, i, 1)
        start = time.perf_counter()
        sizes["block_sparse"] += encoder.encode(after, base).numel()
        seconds["block_sparse"] += time.perf_counter() - start
        for name, (size, took) in alternatives(before[i], after, element_size(plan)).items():
            sizes[name] += size
            seconds[name] += took
        before[i] = None  # one bucket's two versions at a time beside the encoder's copy
    full = sum(plan.bucket_nbytes)
    return {
        **{f"delta_bytes_ratio_qwen05b_{name}": size / full for name, size in sizes.items()},
        **{f"delta_encode_bytes_per_s_{name}": full / s for name, s in seconds.items()},
    }


def packed(plan: BucketPlan, model: CausalLM, index: int, version: int) -> torch.Tensor:
    """Bucket `index` of the model's weights as `version`, a copy of its own."""
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    return pack_bucket(plan, index, tensors, version).clone()


def one_step(model: CausalLM, pad_token_id: int, vocab: int) -> None:
    """One AdamW step at lr 1e-6, bf16 compute, on 4 groups of 4 made-up responses (rewards 1, 0,
    1, 0 in each, so every group has a gradient). Adam's first step moves every weight with a
    gradient by about lr, whatever the gradient's size."""
    train = TrainConfig(lr=1e-6)
    trainer = TrainWorker(model, AlgoConfig(), train, pad_token_id, keep_ref=False, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    samples = []
    for group in range(4):
        prompt = torch.randint(3, vocab, (6,), generator=g).tolist()
        for i in range(4):
            response = torch.randint(3, vocab, (6,), generator=g).tolist()
            samples.append(
                Sample(prompt=Prompt(text="x"), prompt_ids=prompt, group_id=group, index=i,
                       response_ids=response, logprobs=[-1.0] * 6, versions=[0] * 6, loss_mask=[1] * 6,
                       reward=float(i % 2 == 0), status=Status.FINISHED, finish_reason="stop")
            )  # fmt: skip
    trainer.train_step(samples)


def alternatives(old: torch.Tensor, new: torch.Tensor, unit: int) -> dict[str, tuple[int, float]]:
    """The encodings block-sparse was chosen over -> {name: (bytes, encode seconds)}: int32 index +
    value, and zlib (level 1) of the XOR of the two versions' tensor bytes."""
    old_e, new_e = elements(old, unit), elements(new, unit)
    start = time.perf_counter()
    changed = np.flatnonzero(old_e != new_e).astype(np.int32)
    index32 = HEADER_BYTES + changed.nbytes + new_e[changed].nbytes
    index_s = time.perf_counter() - start
    start = time.perf_counter()
    xor = HEADER_BYTES + len(zlib.compress(np.bitwise_xor(old_e, new_e), 1))
    return {"index32": (index32, index_s), "xor_zlib": (xor, time.perf_counter() - start)}
