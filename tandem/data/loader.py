"""PromptLoader: endless shuffled batches of prompts, epoch after epoch, with a resumable cursor."""

import random

from tandem.sample import Prompt


class PromptLoader:
    def __init__(
        self, prompts: list[Prompt], prompt_ids: list[list[int]], batch_size: int, shuffle: bool, seed: int
    ):
        self.prompts, self.prompt_ids = prompts, prompt_ids
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def next_batch(self, count: int | None = None) -> tuple[list[Prompt], list[list[int]]]:
        """The next `count` prompts (default batch_size), continuing into the next epoch as needed."""
        count = self.batch_size if count is None else count
        picked: list[int] = []
        while len(picked) < count:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = self._order[self.cursor : self.cursor + count - len(picked)]
            picked += take
            self.cursor += len(take)
        return [self.prompts[i] for i in picked], [self.prompt_ids[i] for i in picked]

    def upcoming(self, count: int) -> list[int]:
        """The rows of the next `count` prompts `next_batch` will hand out (without handing them)."""
        position = self.epoch * len(self.prompts) + self.cursor
        return [self._row(position + k) for k in range(min(count, len(self.prompts)))]

    def _row(self, position: int) -> int:
        epoch, i = divmod(position, len(self.prompts))
        order = self._order if epoch == self.epoch else self._permutation(epoch)
        return order[i]

    def at(self, position: int) -> tuple[Prompt, list[int]]:
        """The prompt `next_batch` hands out `position`-th (0-based, over all calls and epochs)."""
        row = self._row(position)
        return self.prompts[row], self.prompt_ids[row]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)
