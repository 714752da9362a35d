"""How a run's generate calls sample: rollout.* as the engines' `SamplingParams`. Validation builds
the same ones the loop, the engine builders and `tandem eval` / `generate` use, so a setting the
engines would refuse fails when the config loads."""

from tandem.config.schema import Config
from tandem.sample import SamplingParams


def sampling_params(cfg: Config, temperature: float) -> SamplingParams:
    """rollout.*'s sampling at `temperature` (rollout.temperature, or val_temperature for validation).
    ValueError for a value SamplingParams refuses (e.g. an empty stop string)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=list(r.stop_token_ids),
        stop=list(r.stop),
        min_p=r.min_p,
        repetition_penalty=r.repetition_penalty,
        logprobs_mode=r.logprobs_mode,
    )
