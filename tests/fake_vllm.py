"""A CPU stand-in for the part of vLLM's API that `VLLMEngine` uses, so the adapter's own logic
(requests, abort, the "continue" swap, versions, write-back, seeds) runs in the contract tests on
any machine. It copies vLLM's behaviour as read in its source (vllm/v1/engine/llm_engine.py,
vllm/v1/sample/sampler.py, vllm/sampling_params.py, vllm/outputs.py); it checks the adapter against
that reading, not vLLM itself, which runs only in the "vllm" backend on a GPU.

Like vLLM: every step gives each running request one token (the first step prefills and samples);
DELTA outputs carry the new token with a {token: Logprob} dict; a request ends "stop" on one of its
stop_token_ids and "length" at max_tokens; raw_logprobs is log softmax of the unmodified logits,
processed_logprobs that of the distribution sampled from; a seeded request draws from a generator of
its own seeded once at its start; abort_request drops requests with no output. Unlike vLLM: no KV
cache (every step recomputes the whole sequence), no stop strings, no detokenizer.
"""

import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from importlib.machinery import ModuleSpec
from typing import Any

import torch

from tandem.model.checkpoint import load_model
from tandem.rollout.protocol import SamplingParams as TandemParams
from tandem.rollout.sampler import processed_logprobs


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.stop:
            raise NotImplementedError("the stand-in has no detokenizer: no stop strings")


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, list[int]]:  # noqa: N802 (vLLM's name)
    return {"prompt_token_ids": list(prompt_token_ids)}


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "float32"
    seed: int = 0
    logprobs_mode: str = "raw_logprobs"
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    generation_config: str = "auto"
    disable_log_stats: bool = False
    enable_sleep_mode: bool = False


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


class _Model(torch.nn.Module):
    """vLLM's model as `apply_model` hands it over: `load_weights` of (Hugging Face name, tensor)."""

    def __init__(self, path: str):
        super().__init__()
        self.lm = load_model(path)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.lm.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        return set(params)


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args, self.model = args, _Model(args.model)
        self.model_executor = object()  # vLLM sets it only for an in-process engine core
        self.generator = torch.Generator().manual_seed(args.seed)
        self.requests: dict[str, _Request] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams) -> str:
        if params.output_kind is not RequestOutputKind.DELTA or params.logprobs != 0 or params.n != 1:
            raise NotImplementedError("the stand-in streams DELTA outputs of one sequence with logprobs=0")
        seeded = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        self.requests[request_id] = _Request(prompt["prompt_token_ids"], params, seeded)
        return request_id

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def apply_model(self, fn) -> list[Any]:
        return [fn(self.model)]

    def sleep(self, level: int = 1) -> None:
        """Level 2 discards the weights (vLLM frees their memory): here they become NaN, so serving
        them before new weights are loaded would show."""
        if not self.args.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled (EngineArgs.enable_sleep_mode)")
        if level == 2:
            for p in self.model.parameters():
                p.data.fill_(float("nan"))
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping = False

    def reset_prefix_cache(self) -> bool:
        return not self.requests  # vLLM: only with no request holding blocks

    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        if getattr(self, "sleeping", False):
            raise RuntimeError("step() on a sleeping engine")
        outputs = []
        for request_id, r in list(self.requests.items())[: self.args.max_num_seqs]:
            token, logprob = self._sample(r)
            r.output.append(token)
            reason = None
            if token in r.params.stop_token_ids:
                reason = "stop"
            elif len(r.output) >= r.params.max_tokens:
                reason = "length"
            if reason is not None:
                del self.requests[request_id]
            completion = CompletionOutput([token], [{token: Logprob(logprob)}], reason)
            outputs.append(RequestOutput(request_id, [completion], reason is not None))
        return outputs

    def _sample(self, r: _Request) -> tuple[int, float]:
        ids = torch.tensor(r.prompt + r.output)[None]
        logits = self.model.lm(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=torch.bool))
        logits = logits[:, -1].float()  # (1, V)
        p = r.params
        tandem = TandemParams(
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
        )
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[0, ids[0]] = True
        processed = processed_logprobs(logits, tandem, seen)  # penalty, / T, min-p, top-k, top-p
        if p.temperature == 0:
            token = int(processed.argmax())
        else:  # vLLM's random_sample: argmax(probs / q), q ~ Exp(1) from the request's generator
            q = torch.empty_like(processed).exponential_(generator=r.generator or self.generator)
            token = int((processed.exp() / q).argmax())
        if self.args.logprobs_mode == "raw_logprobs":
            return token, float(torch.log_softmax(logits, -1)[0, token])
        return token, float(processed[0, token])


def install(monkeypatch) -> None:
    """Make `import vllm` (and the submodules VLLMEngine imports) find this stand-in."""
    package = types.ModuleType("vllm")
    package.__spec__ = ModuleSpec("vllm", None)
    package.__path__ = []
    package.EngineArgs, package.SamplingParams = EngineArgs, SamplingParams
    package.TokensPrompt = TokensPrompt
    modules = {"vllm": package, "vllm.sampling_params": types.ModuleType("vllm.sampling_params")}
    modules["vllm.sampling_params"].RequestOutputKind = RequestOutputKind
    for name in ("vllm.v1", "vllm.v1.engine", "vllm.v1.engine.llm_engine"):
        modules[name] = types.ModuleType(name)
    modules["vllm.v1.engine.llm_engine"].LLMEngine = LLMEngine
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the stand-in runs on the CPU
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # restored after the test
