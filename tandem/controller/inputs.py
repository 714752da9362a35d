"""What the loop is given besides the cluster: its prompts (`Data`; how each kind of generate call
samples is `tandem.config.sampling`). Built by `tandem.runtime.roles.build_data` from the config;
the simulator builds its own. Imports no model and no tokenizer.
"""

from dataclasses import dataclass

from tandem.data.loader import PromptLoader
from tandem.sample import Prompt


@dataclass
class Data:
    """What the driver feeds the run: training prompt batches and the held-out prompts."""

    train: PromptLoader
    val_prompts: list[Prompt]
    val_ids: list[list[int]]
