"""`tandem sft`: demonstrations from the task generator, and a checkpoint transformers loads."""

import transformers

from tandem.cli.main import main
from tandem.data.tasks import TASKS
from tandem.data.tokenizer import build_char_tokenizer
from tandem.model.checkpoint import load_model
from tandem.runtime.startup import load_config
from tandem.train.sft import demonstrations

TINY = [
    "sft.hidden_size=32",
    "sft.intermediate_size=64",
    "sft.num_hidden_layers=2",
    "sft.num_attention_heads=4",
    "sft.num_key_value_heads=2",
    "sft.batch_size=8",
    "data.train_size=64",
]


def test_flawed_fraction_replaces_that_share_of_demonstrations():
    tok = build_char_tokenizer()
    cfg = load_config(None, ["sft.flawed_fraction=0.5", "data.train_size=400"])
    task = TASKS.get("addition")()
    samples = demonstrations(cfg, tok, 400)
    wrong = 0
    for s in samples:
        assert s.response_ids[-1] == tok.eos_token_id and s.loss_mask == [1] * len(s.response_ids)
        wrong += tok.decode(s.response_ids, skip_special_tokens=True) != task.solution(s.prompt)
    # Half are flawed, and a flawed answer differs only when the problem has a carry (about half).
    assert 0.15 < wrong / len(samples) < 0.4


def test_sft_writes_a_checkpoint_that_loads_in_tandem_and_transformers(tmp_path, capsys):
    assert main(["sft", f"sft.out={tmp_path}/warm", "sft.steps=3", *TINY]) == 0
    assert "sft step" in capsys.readouterr().out
    model = load_model(tmp_path / "warm")
    assert model.cfg.hidden_size == 32 and model.cfg.tie_word_embeddings
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "warm")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "warm")
    assert hf.config.vocab_size == len(tok) == len(build_char_tokenizer())
