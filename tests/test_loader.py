"""PromptLoader: every prompt once per epoch, reshuffled per epoch, resumable from its cursor."""

from tandem.data.loader import PromptLoader
from tandem.sample import Prompt


def loader(n: int = 10, batch: int = 4, shuffle: bool = True) -> PromptLoader:
    prompts = [Prompt(text=str(i)) for i in range(n)]
    return PromptLoader(prompts, [[i] for i in range(n)], batch, shuffle=shuffle, seed=3)


def test_each_epoch_covers_every_prompt_once_and_batches_are_full():
    data = loader()
    seen = [ids[0] for _ in range(5) for ids in data.next_batch()[1]]  # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new shuffle each epoch
    assert [ids[0] for ids in loader(shuffle=False).next_batch()[1]] == [0, 1, 2, 3]


def test_state_dict_resumes_the_same_sequence():
    a = loader()
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch()[1] for _ in range(4)]
    b = loader()
    b.load_state_dict(state)
    assert [b.next_batch()[1] for _ in range(4)] == expected


def test_at_names_the_prompt_next_batch_handed_out_at_each_position():
    """A resumed run finds the prompt of an in-flight group by its id, which is its position."""
    a = loader()
    drawn = [p for _ in range(8) for p in a.next_batch(3)[0]]  # 24 prompts: into a third epoch
    assert [a.at(i)[0] for i in range(len(drawn))] == drawn
    assert a.at(30)[0] == loader().at(30)[0]  # a position not yet drawn: the same permutation
