"""What the loop is given besides the cluster: its prompts (`Data`) and how each kind of generate
call samples (`sampling_params`). Built by `tandem.runtime.roles.build_data` from the config; the
simulator builds its own. Imports no model and no tokenizer.
"""

from dataclasses import dataclass

from tandem.config import Config
from tandem.data.loader import PromptLoader
from tandem.rollout.protocol import SamplingParams
from tandem.sample import Prompt


@dataclass
class Data:
    """What the driver feeds the run: training prompt batches and the held-out prompts."""

    train: PromptLoader
    val_prompts: list[Prompt]
    val_ids: list[list[int]]


def sampling_params(cfg: Config, temperature: float) -> SamplingParams:
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
