"""tandem.data: the byte-level tokenizer, chat rendering, dataset loading in verl/TRL columns, tasks."""

import json
import os
import random
import string
from pathlib import Path

import pytest

from tandem.data.dataset import load_prompts, save_rows
from tandem.data.tasks import TASKS, make_dataset, split_of
from tandem.data.template import encode_prompts, render_prompt
from tandem.data.tokenizer import build_char_tokenizer, load_tokenizer, save_tokenizer
from tandem.errors import TandemError
from tandem.sample import Prompt

ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
SPECIALS = {"<|pad|>": 0, "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "<|unk|>": 4}


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


# --- tokenizer ---


def test_char_tokenizer_ids_and_round_trip(tok):
    assert len(tok) == 261
    for token, i in SPECIALS.items():
        assert tok.convert_tokens_to_ids(token) == i
        assert tok(token, add_special_tokens=False)["input_ids"] == [i]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 3, 4)
    rng = random.Random(0)
    texts = [ALPHABET, " leading and  double  spaces \n\n", " . , ! ? n't 's", ""]
    texts += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 60))) for _ in range(200)]
    for s in texts:
        ids = tok(s)["input_ids"]  # default call: no special tokens added
        assert len(ids) == len(s) and all(i >= 5 for i in ids)
        assert tok.decode(ids) == s
    mixed = "<|im_start|>user\nhi there<|im_end|>\n"
    ids = tok(mixed)["input_ids"]
    assert ids[0] == 2 and ids.count(3) == 1 and len(ids) == 2 + len("user\nhi there\n")
    assert tok.decode(ids) == mixed
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi there\n"
    assert tok("é")["input_ids"] == [5 + b for b in "é".encode()]  # byte-level: two tokens, no unk
    assert tok.decode(tok("héllo 日本")["input_ids"]) == "héllo 日本"


@pytest.mark.parametrize("model_type", [None, "qwen2", "qwen3", "llama"])
def test_char_tokenizer_is_deterministic_and_reloads_through_auto_tokenizer(tok, tmp_path, model_type):
    """Also beside a model's config.json, where transformers picks the tokenizer class by model type."""
    import json

    assert build_char_tokenizer().get_vocab() == tok.get_vocab()
    path = save_tokenizer(tok, str(tmp_path / "tok"))
    if model_type:
        (tmp_path / "tok" / "config.json").write_text(json.dumps({"model_type": model_type}))
    loaded = load_tokenizer(Path(os.path.relpath(path)))  # a relative Path, as a checkpoint dir often is
    texts = ["<|im_start|>user\n12+9=<|im_end|>\n<|im_start|>assistant\n", " two  spaces\n\n", "3 7 12 -> 33"]
    for text in texts:
        assert (
            loaded(text, add_special_tokens=False)["input_ids"]
            == tok(text, add_special_tokens=False)["input_ids"]
        )
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 3)
    s = "Hello,  world!\n<|im_end|>"
    assert loaded(s)["input_ids"] == tok(s)["input_ids"]
    assert loaded.decode(loaded(s)["input_ids"]) == s
    messages = [{"role": "user", "content": "1+2="}]
    assert render_prompt(loaded, Prompt(messages=messages)) == render_prompt(tok, Prompt(messages=messages))


def test_load_tokenizer_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(TandemError, match="nope"):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(TandemError, match="empty.*notes.txt"):
        load_tokenizer(str(empty))


# --- template ---


def test_chat_template_is_chatml(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "23+58="}]
    text = render_prompt(tok, Prompt(messages=messages))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n23+58=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_prompt(tok, Prompt(text="plain 1+1=")) == "plain 1+1="


def test_encode_prompts(tok):
    prompts = [Prompt(messages=[{"role": "user", "content": "ab"}]), Prompt(text="xyz")]
    ids = encode_prompts(tok, prompts, max_prompt_length=64)
    assert ids[1] == tok("xyz")["input_ids"] and len(ids[1]) == 3  # plain text: no bos/eos added
    assert tok.decode(ids[0]) == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0][0] == 2 and ids[0].count(2) == 2


def test_encode_prompts_too_long_names_row_length_limit_and_source(tok):
    prompts = [Prompt(text="ok"), Prompt(text="x" * 20)]
    with pytest.raises(TandemError) as e:
        encode_prompts(tok, prompts, max_prompt_length=10, source="train.jsonl")
    msg = str(e.value)
    for part in ("row 1", "20 tokens", "data.max_prompt_length=10", "train.jsonl", "context"):
        assert part in msg


def test_render_prompt_without_chat_template(tok):
    plain = build_char_tokenizer()
    plain.chat_template = None
    with pytest.raises(TandemError, match="chat template"):
        render_prompt(plain, Prompt(messages=[{"role": "user", "content": "hi"}]))


# --- dataset ---

VERL_ROWS = [
    {
        "data_source": "addition",
        "prompt": [{"role": "user", "content": "23+58="}],
        "reward_model": {"style": "rule", "ground_truth": "81"},
        "extra_info": {"split": "train", "index": 0},
        "difficulty": 2,
    },
    {
        "data_source": "addition",
        "prompt": [{"role": "system", "content": "sum"}, {"role": "user", "content": "1+2="}],
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {"split": "train", "index": 1},
        "difficulty": 1,
    },
]
VERL_PROMPTS = [
    Prompt(
        messages=[{"role": "user", "content": "23+58="}],
        ground_truth="81",
        data_source="addition",
        extra_info={"split": "train", "index": 0},
        columns={"difficulty": 2},
    ),
    Prompt(
        messages=[{"role": "system", "content": "sum"}, {"role": "user", "content": "1+2="}],
        ground_truth="3",
        data_source="addition",
        extra_info={"split": "train", "index": 1},
        columns={"difficulty": 1},
    ),
]


@pytest.mark.parametrize("ext", [".jsonl", ".json", ".parquet"])
def test_load_verl_format(tmp_path, ext):
    path = str(tmp_path / f"data{ext}")
    save_rows(VERL_ROWS, path)
    assert load_prompts(path) == VERL_PROMPTS


def test_load_json_array(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(VERL_ROWS, indent=2))
    assert load_prompts(str(path)) == VERL_PROMPTS


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
def test_load_trl_format(tmp_path, ext):
    plain = [{"prompt": "2+2=", "solution": "4"}, {"prompt": "3+3=", "solution": "6"}]
    path = str(tmp_path / f"plain{ext}")
    save_rows(plain, path)
    assert load_prompts(path) == [
        Prompt(text="2+2=", ground_truth="4", columns={"solution": "4"}),
        Prompt(text="3+3=", ground_truth="6", columns={"solution": "6"}),
    ]
    chat = [{"prompt": [{"role": "user", "content": "2+2="}], "answer": "4", "ground_truth": "four"}]
    path = str(tmp_path / f"chat{ext}")
    save_rows(chat, path)
    (p,) = load_prompts(path)
    assert p.messages == [{"role": "user", "content": "2+2="}] and p.text is None
    assert p.ground_truth == "four"  # ground_truth comes before answer and solution
    assert p.columns == {"answer": "4", "ground_truth": "four"}


def test_load_custom_prompt_key_and_nested_parquet_is_plain_python(tmp_path):
    truth = {"target": 3, "numbers": [1, 2]}
    rows = [{"question": "q?", "reward_model": {"style": "rule", "ground_truth": truth}}]
    path = str(tmp_path / "d.parquet")
    save_rows(rows, path)
    (p,) = load_prompts(path, prompt_key="question")
    assert p.text == "q?"
    assert p.ground_truth == {"target": 3, "numbers": [1, 2]}
    assert type(p.ground_truth["numbers"]) is list


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_errors(tmp_path):
    with pytest.raises(TandemError, match="missing.jsonl does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(TandemError, match=r"data\.csv.*unsupported.*\.jsonl, \.json, \.parquet"):
        load_prompts(write(tmp_path, "data.csv", "prompt\nhi\n"))
    bad = write(tmp_path, "bad.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",}\n')
    with pytest.raises(TandemError, match="bad.jsonl has malformed JSON on line 3"):
        load_prompts(bad)
    no_prompt = write(tmp_path, "np.jsonl", '{"prompt": "a"}\n{"question": "b", "answer": "c"}\n')
    match = r"np.jsonl: row 1 \(line 2\) has no 'prompt' column.*'question', 'answer'"
    with pytest.raises(TandemError, match=match):
        load_prompts(no_prompt)
    for i, empty in enumerate(['""', "[]", '"  "']):
        path = write(tmp_path, f"empty{i}.jsonl", '{"prompt": "a"}\n{"prompt": ' + empty + "}\n")
        with pytest.raises(TandemError, match=rf"empty{i}.jsonl: row 1 .*empty"):
            load_prompts(path)
    for i, wrong in enumerate(["3", '{"role": "user"}', '["hi"]', '[{"role": "user", "content": null}]']):
        path = write(tmp_path, f"wrong{i}.jsonl", '{"prompt": ' + wrong + "}\n")
        with pytest.raises(TandemError, match=rf"wrong{i}.jsonl: row 0 .*neither a string nor a list"):
            load_prompts(path)
    with pytest.raises(TandemError, match="nothing.jsonl has no rows"):
        load_prompts(write(tmp_path, "nothing.jsonl", "\n\n"))
    with pytest.raises(TandemError, match="notobj.jsonl: row 0 .* not an object"):
        load_prompts(write(tmp_path, "notobj.jsonl", "[1, 2]\n"))
    with pytest.raises(TandemError, match="junk.parquet is not a readable parquet file"):
        load_prompts(write(tmp_path, "junk.parquet", "not parquet"))


def test_error_messages_are_one_paragraph(tmp_path):
    with pytest.raises(TandemError) as e:
        load_prompts(write(tmp_path, "np.jsonl", '{"q": 1}\n'))
    assert "\n" not in str(e.value)


# --- tasks ---


def _content(row):
    return row["prompt"][-1]["content"]


def _has_carry(a: int, b: int) -> bool:
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def _uses_numbers_once(expr: str, numbers: list[int]) -> bool:
    used = [int(t) for t in "".join(c if c.isdigit() else " " for c in expr).split()]
    return sorted(used) == sorted(numbers)


def test_tasks_registry():
    assert TASKS.names() == ["addition", "addition_judge", "countdown", "multiply", "reverse"]
    with pytest.raises(TandemError, match="addition, addition_judge, countdown, multiply, reverse"):
        TASKS.get("sudoku")


@pytest.mark.parametrize("split", ["train", "test"])
def test_addition(split):
    task = TASKS.get("addition")()
    rows = task.make_rows(300, seed=1, split=split)
    carries = 0
    for i, row in enumerate(rows):
        a, b = _content(row).removesuffix("=").split("+")
        assert 0 <= int(a) < 100 and 0 <= int(b) < 100
        expected = str(int(a) + int(b))
        assert row["reward_model"]["ground_truth"] == expected == task.solution(row)
        assert row["data_source"] == "addition" and row["extra_info"] == {"split": split, "index": i}
        flawed = task.flawed_solution(row, random.Random(0))
        assert flawed.isdigit()
        if _has_carry(int(a), int(b)):
            carries += 1
            assert flawed != expected
        else:
            assert flawed == expected
    assert 0.35 < carries / len(rows) < 0.65
    assert task.flawed_solution({"prompt": [{"role": "user", "content": "58+67="}]}, random.Random(0)) == "15"


@pytest.mark.parametrize("split", ["train", "test"])
def test_countdown(split):
    task = TASKS.get("countdown")()
    for row in task.make_rows(200, seed=2, split=split):
        truth = row["reward_model"]["ground_truth"]
        numbers, target = truth["numbers"], truth["target"]
        assert len(numbers) == 3 and all(1 <= n <= 20 for n in numbers) and target >= 1
        assert _content(row) == " ".join(map(str, numbers)) + f" -> {target}"
        answer = task.solution(row)
        assert set(answer) <= set("0123456789+-*()") and _uses_numbers_once(answer, numbers)
        assert eval(answer) == target
        flawed = task.flawed_solution(row, random.Random(0))
        assert flawed == "+".join(map(str, numbers))


@pytest.mark.parametrize("split", ["train", "test"])
def test_reverse(split):
    task = TASKS.get("reverse")()
    rng = random.Random(0)
    for row in task.make_rows(200, seed=3, split=split):
        word = _content(row).removeprefix("reverse: ")
        assert 3 <= len(word) <= 6 and set(word) <= set(string.ascii_lowercase)
        assert row["reward_model"]["ground_truth"] == word[::-1] == task.solution(row)
        flawed = task.flawed_solution(row, rng)
        assert flawed in (word, word[-1] + word[1:-1] + word[0])


@pytest.mark.parametrize("name", ["addition", "countdown", "reverse", "multiply"])
def test_tasks_deterministic_and_splits_disjoint(name):
    task = TASKS.get(name)()
    train = task.make_rows(500, seed=0, split="train")
    assert train == task.make_rows(500, seed=0, split="train")
    assert train != task.make_rows(500, seed=1, split="train")
    test = task.make_rows(200, seed=0, split="test")
    assert not {_content(r) for r in train} & {_content(r) for r in test}
    if name == "addition":  # a+b and b+a are one problem: the answer to a test problem is never trained on
        pairs = {tuple(sorted(_content(r)[:-1].split("+"))) for r in train}
        assert not pairs & {tuple(sorted(_content(r)[:-1].split("+"))) for r in test}
    assert 0.05 < sum(split_of(str(i)) == "test" for i in range(2000)) / 2000 < 0.15
    with pytest.raises(TandemError, match="train, test"):
        task.make_rows(3, seed=0, split="val")


@pytest.mark.parametrize("ext", [".jsonl", ".parquet"])
@pytest.mark.parametrize("name", ["addition", "countdown", "reverse"])
def test_make_dataset_round_trip(tmp_path, tok, name, ext):
    path = make_dataset(name, str(tmp_path / "sub" / f"{name}{ext}"), n=50, seed=0, split="test")
    prompts = load_prompts(path)
    rows = TASKS.get(name)().make_rows(50, seed=0, split="test")
    task = TASKS.get(name)()
    assert len(prompts) == 50
    for p, row in zip(prompts, rows, strict=True):
        assert p.messages == row["prompt"] and p.ground_truth == row["reward_model"]["ground_truth"]
        assert p.data_source == name and p.extra_info == row["extra_info"]
        assert task.solution(p) == task.solution(row)
    ids = encode_prompts(tok, prompts, max_prompt_length=64, source=path)
    assert max(map(len, ids)) < 64  # short enough for a small character-level context
