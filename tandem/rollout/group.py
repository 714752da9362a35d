"""Expand prompts into GRPO groups: n samples per prompt sharing a group id."""

from tandem.sample import Prompt, Sample


def make_groups(
    prompts: list[Prompt], prompt_ids: list[list[int]], n: int, first_group: int = 0
) -> list[Sample]:
    return [
        Sample(prompt=p, prompt_ids=list(ids), group_id=first_group + g, index=i)
        for g, (p, ids) in enumerate(zip(prompts, prompt_ids, strict=True))
        for i in range(n)
    ]
