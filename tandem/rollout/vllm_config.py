"""What rollout.engine=vllm asks of a run's settings, checked without vLLM or a model: whether vLLM
is installed, and which of vLLM's logprobs modes records the logprob each call asks for. The config
check and the adapter (`tandem.rollout.vllm_engine`) both ask here.
"""

from collections.abc import Sequence
from importlib.util import find_spec

from tandem.errors import TandemError
from tandem.rollout.protocol import SamplingParams


def require_vllm() -> None:
    """TandemError unless the vllm package is installed (checked without importing it: seconds)."""
    if find_spec("vllm") is None:
        raise TandemError(
            "rollout.engine=vllm needs the vllm package, which is not installed here. vLLM runs on "
            "an NVIDIA GPU: on a GPU machine, `pip install vllm` into an environment whose torch is "
            "the CUDA build vLLM pins (its wheel brings it; it replaces a CPU-only torch). Or use "
            "rollout.engine=builtin or rollout.engine=paged, which run anywhere."
        )


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
