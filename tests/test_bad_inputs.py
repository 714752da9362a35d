"""The bad-input corpus: a mistake in a config value, a recipe, a data file, a model, a reward function,
a path, the placement or a flag ends the command with exit 2 and one paragraph (no traceback) that
names the offending key, flag or file, in seconds, before any Ray actor starts.

Each case runs `tandem ...` in-process through `tandem.cli.main.main`. Ray itself is forbidden to
start (ray.init raises) except for the few cases that need the cluster's resources to be wrong
about; those run on the shared local Ray with the placement-group reservation forbidden, so no actor
can start either.
"""

import dataclasses
import importlib.metadata
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml
from helpers import write_tiny_checkpoint
from safetensors.torch import load_file, save_file

import tandem.runtime.cluster as cluster
from tandem.cli.main import main
from tandem.config.loader import UniqueKeyLoader
from tandem.data.dataset import save_rows
from tandem.data.tokenizer import build_char_tokenizer
from tandem.errors import TandemError
from tandem.model.config import ModelConfig, resolve_model_path
from tandem.runtime.memory import check_memory
from tandem.runtime.roles import PromptLimit
from tandem.runtime.startup import load_config
from tandem.runtime.train_checks import check_training
from tandem.sample import Prompt

FAST = ["rollout.batch_size=2", "rollout.n=2", "data.train_size=16", "data.val_size=4", "run.progress=false"]
SECONDS = 10  # "in seconds": the slowest case takes ~2 s on 2 cores

# name -> (command line, regex the one paragraph must match). "{r}" is the corpus directory and
# "{m}" a good tiny checkpoint; `tandem train` and `tandem eval` get model.path={m}, FAST and
# run.out_dir first, so a case's own overrides win.
CASES: dict[str, tuple[list[str], str]] = {
    # config values
    "unknown key": (
        ["train", "rollout.temprature=1.0"],
        r"'rollout.temprature'.*Did you mean 'rollout.temperature'",
    ),
    "unknown section": (["train", "rolout.n=3"], r"'rolout'.*Did you mean 'rollout'"),
    "renamed key": (["train", "model.dtype=bfloat16"], r"'model.dtype' is gone: use train.dtype"),
    "not an integer": (["train", "rollout.n=many"], r"'rollout.n' must be an integer, got 'many'"),
    "float for an integer": (["train", "rollout.n=1.5"], r"'rollout.n' must be an integer, got 1.5"),
    "not a list": (["train", "data.train_files=a.jsonl"], r"'data.train_files' must be a list"),
    "section as a value": (["train", "run=3"], r"'run' is a section"),
    "value as a section": (["train", "run.steps.x=1"], r"'run.steps' must be an integer"),
    "override without =": (["train", "rollout.n"], r"Argument 'rollout.n' is neither a recipe"),
    "override without a key": (["train", "=3"], r"Override '=3' is not of the form"),
    "unknown mode": (["train", "run.mode=fast"], r"'run.mode' is 'fast'.*sync, one_step_off, async"),
    "zero samples": (["train", "rollout.n=0"], r"'rollout.n' must be >= 1"),
    "negative temperature": (["train", "rollout.temperature=-1"], r"'rollout.temperature' must be >= 0"),
    "top_p of 0": (["train", "rollout.top_p=0"], r"'rollout.top_p' must be in \(0, 1\]"),
    "zero learning rate": (["train", "train.lr=0"], r"'train.lr' must be > 0"),
    "one beta": (["train", "train.betas=[0.9]"], r"'train.betas' must be two numbers"),
    "zero steps": (["train", "run.steps=0"], r"'run.steps' must be >= 1"),
    "clip_low of 1.5": (["train", "algo.clip_low=1.5"], r"'algo.clip_low' must be in \[0, 1\)"),
    "dual clip of 1": (["train", "algo.clip_c=1"], r"'algo.clip_c' must be > 1"),
    "unknown estimator": (["train", "algo.adv_estimator=ppo2"], r"'algo.adv_estimator' is 'ppo2'.*grpo"),
    "unknown policy loss": (
        ["train", "algo.policy_loss=dpo"],
        r"'algo.policy_loss' is 'dpo'.*gspo, ppo_clip",
    ),
    "unknown loss aggregation": (["train", "algo.loss_agg=mean"], r"'algo.loss_agg' is 'mean'.*token-mean"),
    "two importance weights": (
        ["train", "algo.corrections=[tis,mis]"],
        r"'algo.corrections' combines tis, mis",
    ),
    "interpolate without decoupled": (["train", "algo.prox_logprob=interpolate"], r"'algo.prox_logprob'"),
    "float16 training": (["train", "train.dtype=float16"], r"'train.dtype' is 'float16'.*loss scaling"),
    "offload without fsdp2": (["train", "train.offload=optimizer"], r"'train.offload'.*train.strategy=fsdp2"),
    "unknown device": (["train", "run.device=tpu"], r"'run.device' is 'tpu'"),
    "unknown engine": (["train", "rollout.engine=sglang"], r"'rollout.engine' is 'sglang'.*builtin, paged"),
    "unknown transport": (["train", "sync.transport=nccl"], r"'sync.transport' is 'nccl'"),
    "zero reward timeout": (["train", "reward.timeout_s=0"], r"'reward.timeout_s' must be > 0"),
    "zero reward bound": (["train", "reward.max_abs=0"], r"'reward.max_abs' must be > 0"),
    "negative import timeout": (
        ["train", "reward.import_timeout_s=-1"],
        r"'reward.import_timeout_s' must be > 0",
    ),
    "reward module that hangs at import": (
        ["train", "reward.fn={r}/sleepy_rewards.py:score", "reward.import_timeout_s=1"],
        r"Importing reward function .*sleepy_rewards.py:score' did not finish within "
        r"reward.import_timeout_s=1 s",
    ),
    "sleeping engine in async": (
        ["train", "run.mode=async", "rollout.free_memory_during_train=true"],
        r"'rollout.free_memory_during_train' needs run.mode=sync",
    ),
    "unknown task": (["train", "data.task=sudoku"], r"'data.task' is 'sudoku'.*addition"),
    "no room for a prompt": (
        ["train", "rollout.max_new_tokens=1000"],
        r"rollout.max_new_tokens=1000 leaves no room",
    ),
    # placement (checked in the config)
    "placement without actor_train": (
        ["train", "placement.groups=[[generate,logp]]", "placement.ratios=[1.0]"],
        r"'placement.groups' must place 'actor_train'",
    ),
    "ratios not adding up": (
        ["train", "placement.groups=[[actor_train,logp],generate]", "placement.ratios=[0.5,0.6]"],
        r"'placement.ratios' must add up to 1",
    ),
    "GPUs for a CPU run": (["train", "run.device=cpu", "placement.num_gpus=1"], r"'placement.num_gpus' is 1"),
    "negative CPUs": (["train", "placement.num_cpus=-1"], r"'placement.num_cpus' must be >= 0"),
    # recipes
    "missing recipe": (["train", "{r}/nope.yaml"], r"Recipe file \S*nope.yaml does not exist"),
    "malformed recipe": (["train", "{r}/malformed.yaml"], r"Recipe \S*malformed.yaml is not valid YAML"),
    "empty recipe": (["train", "{r}/empty.yaml"], r"Recipe \S*empty.yaml is empty"),
    "recipe that is a list": (["train", "{r}/list.yaml"], r"Recipe \S*list.yaml must be a mapping"),
    "unknown section in a recipe": (
        ["train", "{r}/runs.yaml"],
        r"Unknown config key 'runs'.*Did you mean 'run'",
    ),
    "scalar section in a recipe": (["train", "{r}/scalar.yaml"], r"'sync' is a section"),
    "two recipes": (["train", "{r}/empty.yaml", "{r}/list.yaml"], r"Argument '\S*list.yaml' is neither"),
    # keys written as for verl
    "verl batch size": (
        ["train", "data.train_batch_size=64"],
        r"'data.train_batch_size' is verl's.*'rollout.batch_size'",
    ),
    "verl learning rate": (["train", "actor_rollout_ref.actor.optim.lr=1e-6"], r"is verl's.*'train.lr'"),
    "verl key without equivalent": (
        ["train", "trainer.nnodes=2"],
        r"'trainer.nnodes' is verl's; tandem has no equivalent",
    ),
    "verl critic": (["train", "critic.model.path=x"], r"'critic.model.path' is verl's.*'critic.path'"),
    "verl recipe": (["train", "{r}/verl.yaml"], r"'algorithm.adv_estimator' is verl's.*'algo.adv_estimator'"),
    # data files
    "missing data file": (
        ["train", "data.train_files=[{r}/nope.jsonl]"],
        r"Dataset file \S*nope.jsonl does not exist",
    ),
    "empty data file": (
        ["train", "data.train_files=[{r}/empty.jsonl]"],
        r"Dataset \S*empty.jsonl has no rows",
    ),
    "wrong prompt_key": (
        ["train", "data.train_files=[{r}/question.jsonl]"],
        r"question.jsonl: row 0 \(line 1\) has no 'prompt' column; its columns are 'question'",
    ),
    "malformed JSON line": (
        ["train", "data.train_files=[{r}/malformed.jsonl]"],
        r"malformed.jsonl has malformed JSON on line 2",
    ),
    "row that is a list": (
        ["train", "data.train_files=[{r}/list_row.jsonl]"],
        r"list_row.jsonl: row 0.*is a JSON list",
    ),
    "prompt that is a number": (
        ["train", "data.train_files=[{r}/number.jsonl]"],
        r"number.jsonl: row 0 \(line 1\) has a 'prompt' that is neither",
    ),
    "message without content": (
        ["train", "data.train_files=[{r}/no_content.jsonl]"],
        r"no_content.jsonl: row 0",
    ),
    "extra_info not an object": (
        ["train", "data.train_files=[{r}/extra.jsonl]"],
        r"extra.jsonl: row 0 \(line 1\) has an extra_info of type str",
    ),
    "blank prompt": (
        ["train", "data.train_files=[{r}/blank.jsonl]"],
        r"blank.jsonl: row 0 \(line 1\) has an empty 'prompt'",
    ),
    "prompt too long": (
        ["train", "data.train_files=[{r}/long.jsonl]"],
        r"row 0 of \S*long.jsonl is 200 tokens long",
    ),
    "parquet without the prompt column": (
        ["train", "data.train_files=[{r}/question.parquet]"],
        r"question.parquet: row 0 has no 'prompt' column",
    ),
    "corrupt parquet": (
        ["train", "data.train_files=[{r}/corrupt.parquet]"],
        r"corrupt.parquet is not a readable parquet",
    ),
    "unsupported extension": (
        ["train", "data.train_files=[{r}/rows.csv]"],
        r"rows.csv has an unsupported extension '.csv'",
    ),
    "data file that is a directory": (
        ["train", "data.train_files=[{r}]"],
        r"Dataset file \S+ is a directory",
    ),
    "data file not UTF-8": (["train", "data.train_files=[{r}/latin1.jsonl]"], r"latin1.jsonl is not UTF-8"),
    "missing validation file": (
        ["train", "data.train_files=[{r}/good.jsonl]", "data.val_files=[{r}/nope_val.jsonl]"],
        r"nope_val.jsonl does not exist",
    ),
    # models
    "missing model directory": (
        ["train", "model.path={r}/nomodel"],
        r"Model path \S*nomodel \(model.path\) does not exist",
    ),
    "unknown built-in model": (["train", "model.path=builtin:sudoku"], r"No built-in model 'builtin:sudoku'"),
    "distillation without its teacher": (  # as `tandem train recipes/distill.yaml` before its teacher
        ["train", "algo.distill.teacher={r}/noteacher"],
        r"\S*noteacher \(algo.distill.teacher\) does not exist.*a plain `tandem train` leaves "
        r"runs/default/checkpoints/final, the one recipes/distill.yaml reads",
    ),
    "no config.json": (["train", "model.path={r}/m_no_config"], r"No config.json in \S*m_no_config"),
    "config.json not JSON": (
        ["train", "model.path={r}/m_config_text"],
        r"m_config_text/config.json is not valid JSON",
    ),
    "config.json without hidden_size": (
        ["train", "model.path={r}/m_no_hidden"],
        r"m_no_hidden/config.json: hidden_size is missing",
    ),
    "unsupported architecture": (
        ["train", "model.path={r}/m_gpt2"],
        r"m_gpt2/config.json: model_type 'gpt2' is not supported",
    ),
    "GELU activation": (
        ["train", "model.path={r}/m_gelu"],
        r"m_gelu/config.json: hidden_act='gelu' is not supported",
    ),
    "sliding window": (
        ["train", "model.path={r}/m_sliding"],
        r"m_sliding/config.json: use_sliding_window=true",
    ),
    "unknown RoPE type": (["train", "model.path={r}/m_rope"], r"m_rope/config.json.*magic"),
    "missing model.safetensors": (
        ["train", "model.path={r}/m_no_weights"],
        r"No model.safetensors .* in \S*m_no_weights",
    ),
    "corrupt model.safetensors": (
        ["train", "model.path={r}/m_garbage"],
        r"m_garbage/model.safetensors is not readable",
    ),
    "truncated model.safetensors": (
        ["train", "model.path={r}/m_truncated"],
        r"m_truncated/model.safetensors is not readable",
    ),
    "weights of another shape": (
        ["train", "model.path={r}/m_shapes"],
        r"m_shapes/model.safetensors has shape \[64, 32\].*\[65, 32\]",
    ),
    "a layer's weights missing": (
        ["train", "model.path={r}/m_layers"],
        r"m_layers does not match its config.json: missing \['model.layers.2",
    ),
    "integer weights": (
        ["train", "model.path={r}/m_int8"],
        r"model.embed_tokens.weight in \S*m_int8/model.safetensors is I8",
    ),
    "index naming a missing shard": (
        ["train", "model.path={r}/m_index"],
        r"m_index/model.safetensors.index.json names shard files.*shard-2",
    ),
    "missing tokenizer": (
        ["train", "model.tokenizer={r}/notok"],
        r"Tokenizer directory '\S*notok' does not exist",
    ),
    # reward functions
    "unknown reward name": (["train", "reward.fn=exact_matsh"], r"Unknown reward function 'exact_matsh'"),
    "reward module missing": (
        ["train", "reward.fn=no_such_module:score"],
        r"Cannot import module 'no_such_module'",
    ),
    "reward file missing": (
        ["train", "reward.fn={r}/nope.py:score"],
        r"Reward function file '\S*nope.py'.*does not exist",
    ),
    "reward function missing": (
        ["train", "reward.fn={r}/rewards.py:scor"],
        r"rewards.py:scor'.*has no attribute 'scor'",
    ),
    "reward not callable": (
        ["train", "reward.fn={r}/rewards.py:THRESHOLD"],
        r"rewards.py:THRESHOLD' names a float, which is not callable",
    ),
    "reward of no known signature": (
        ["train", "reward.fn={r}/rewards.py:two_args"],
        r"rewards.py:two_args' has parameters \(a, b\)",
    ),
    "reward needing a parameter never passed": (
        ["train", "reward.fn={r}/rewards.py:needs_weight"],
        r"rewards.py:needs_weight' requires the parameter 'weight'",
    ),
    "reward file with a syntax error": (
        ["train", "reward.fn={r}/syntax.py:score"],
        r"syntax.py'.*raised SyntaxError.*syntax.py:2",
    ),
    "reward file failing as it imports": (
        ["train", "reward.fn={r}/raises.py:score"],
        r"raises.py'.*raised NameError.*raises.py:1",
    ),
    # paths
    "unwritable run.out_dir": (
        ["train", "run.out_dir={r}/rewards.py/runs"],
        r"Cannot write to \S*rewards.py/runs/default/checkpoints, the directory run.out_dir sets",
    ),
    "unwritable sft.out": (
        ["sft", "sft.out={r}/rewards.py/sft"],
        r"Cannot write to \S*rewards.py/sft, the directory sft.out sets",
    ),
    "missing sft.init_from": (
        ["sft", "sft.init_from={r}/nomodel", "sft.out={r}/sft"],
        r"Model path \S*nomodel does not exist",
    ),
    # Ray
    "unreachable ray.address": (
        ["train", "ray.address=127.0.0.1:1"],
        r"ray.address='127.0.0.1:1': nothing answers at \S+:1",
    ),
    "malformed ray.address": (["train", "ray.address=nonsense"], r"ray.address='nonsense'"),
    "unreachable Ray client address": (
        ["train", "ray.address=ray://127.0.0.1:1"],
        r"ray.address='ray://127.0.0.1:1': nothing answers",
    ),
    "more CPUs than the cluster has": (
        ["train", "placement.num_cpus=64"],
        r"'placement.num_cpus' asks for 64 CPUs, but the Ray cluster has 4 CPUs",
    ),
    "GPUs on a CPU-only cluster": (
        ["train", "placement.num_gpus=1"],
        r"'placement.num_gpus' asks for 1 GPUs, but the Ray cluster has 4 CPUs and 0 GPUs",
    ),
    "cuda on a CPU-only cluster": (
        ["train", "run.device=cuda"],
        r"'run.device' is 'cuda', but the Ray cluster has no GPU",
    ),
    # CLI flags
    "no samples from generate": (
        ["generate", "1+1=", "--model", "{m}", "--n", "0"],
        r"^error: --n must be >= 1",
    ),
    "generate --n not a number": (
        ["generate", "1+1=", "--n", "x"],
        r"tandem generate: argument --n: invalid int value: 'x'",
    ),
    "negative --temperature": (
        ["generate", "1+1=", "--model", "{m}", "--temperature", "-1"],
        r"^error: --temperature must be >= 0",
    ),
    "--max-new-tokens past the context": (
        ["generate", "1+1=", "--model", "{m}", "--max-new-tokens", "1000"],
        r"^error: --max-new-tokens 1000 leaves no room",
    ),
    "missing --model": (
        ["generate", "1+1=", "--model", "{r}/nomodel"],
        r"Model path \S*nomodel \(--model\) does not exist",
    ),
    "negative --show": (["eval", "--show", "-1"], r"tandem eval: argument --show: must be >= 0, got -1"),
    "--show not a number": (["eval", "--show", "abc"], r"argument --show: must be an integer, got 'abc'"),
    "missing --data": (["eval", "--data", "{r}/nope.jsonl"], r"Dataset file \S*nope.jsonl does not exist"),
    "unknown command": (["trian"], r"argument command: invalid choice: 'trian'"),
    "data make with no rows": (
        ["data", "make", "addition", "--out", "{r}/x.jsonl", "--n", "0"],
        r"argument --n: must be >= 1",
    ),
    "data make of an unknown task": (
        ["data", "make", "sudoku", "--out", "{r}/x.jsonl"],
        r"task 'sudoku'.*addition",
    ),
    "data make without --out": (["data", "make", "addition"], r"the following arguments are required: --out"),
    # tandem convert: where it writes is checked before it reads (issue 51)
    "convert into a file's folder": (
        ["convert", "{m}", "{r}/rows.csv/out"],
        r"^error: Cannot write \S*rows.csv/out: \S*rows.csv is not a directory",
    ),
    "convert into an existing directory": (["convert", "{m}", "{r}"], r"^error: \S+ exists already"),
    "convert of no source": (["convert", "{r}/nope.gguf", "{r}/out"], r"^error: \S*nope.gguf does not exist"),
    "empty prompt to generate": (["generate", ""], r"^error: tandem generate: the prompt is empty"),
    "blank prompt to generate": (["generate", "  "], r"^error: tandem generate: the prompt is empty"),
    # checked before anything starts (issue 25)
    "key twice in a recipe": (
        ["train", "{r}/twice.yaml"],
        r"Recipe \S*twice.yaml sets 'run' twice \(lines 1 and 5\)",
    ),
    "nested key twice in a recipe": (
        ["train", "{r}/twice_nested.yaml"],
        r"Recipe \S*twice_nested.yaml sets 'rollout.n' twice \(lines 2 and 4\)",
    ),
    "key twice in the first data row": (
        ["train", "data.train_files=[{r}/twice_first.jsonl]"],
        r"twice_first.jsonl: row 0 \(line 1\) has the key 'prompt' twice",
    ),
    "key twice in a later data row": (
        ["train", "data.train_files=[{r}/twice_later.jsonl]"],
        r"twice_later.jsonl: row 1 \(line 3\) has the key 'answer' twice",
    ),
    "key twice in a message": (
        ["train", "data.train_files=[{r}/twice_message.jsonl]"],
        r"twice_message.jsonl: row 0 \(line 1\) has the key 'content' twice",
    ),
    "key twice in a JSON array row": (
        ["train", "data.train_files=[{r}/twice_array.json]"],
        r"twice_array.json: row 1 \(line 3\) has the key 'prompt' twice",
    ),
    "empty run.name": (["train", "run.name="], r"'run.name' is '', not a usable directory name"),
    "run.name with a slash": (["train", "run.name=a/b"], r"'run.name' is 'a/b', not a usable directory name"),
    "run.name of ..": (["train", "run.name=.."], r"'run.name' is '..', not a usable directory name"),
    "run.name of .": (["train", "run.name=."], r"'run.name' is '.', not a usable directory name"),
    "negative threads": (["train", "run.threads=-1"], r"'run.threads' must be >= 0 \(0 = "),
    "no synthetic rows": (["train", "data.train_size=0"], r"'data.train_size' must be >= 1"),
    "negative Ray CPUs": (["train", "ray.num_cpus=-2"], r"'ray.num_cpus' must be >= 0"),
    "negative weight decay": (["train", "train.weight_decay=-0.1"], r"'train.weight_decay' must be >= 0"),
    "negative KL coefficient": (["train", "algo.kl_coef=-0.1"], r"'algo.kl_coef' must be >= 0"),
    "min_lr_ratio above 1": (["train", "train.min_lr_ratio=2"], r"'train.min_lr_ratio' must be in \[0, 1\]"),
    "one sample per group with grpo": (
        ["train", "rollout.n=1"],
        r"'rollout.n' is 1, but algo.adv_estimator='grpo'.*rollout.n >= 2.*gae, reinforce_plus_plus",
    ),
    "one sample per group with rloo": (
        ["train", "rollout.n=1", "algo.adv_estimator=rloo"],
        r"'rollout.n' is 1, but algo.adv_estimator='rloo'",
    ),
    "one sample per group with drgrpo": (
        ["train", "rollout.n=1", "algo.adv_estimator=drgrpo"],
        r"'rollout.n' is 1, but algo.adv_estimator='drgrpo'",
    ),
    "one sample per group with a group baseline": (
        ["train", "rollout.n=1", "algo.adv_estimator=reinforce_plus_plus_baseline"],
        r"'rollout.n' is 1, but algo.adv_estimator='reinforce_plus_plus_baseline'",
    ),
    "more samples than memory": (
        ["train", "rollout.n=100000000"],
        r"at least [\d.]+ GiB of memory, and this machine has [\d.]+ GiB: rollout.batch_size=2 prompts x "
        r"rollout.n=100000000 samples",
    ),
    "more prompts than memory": (
        ["train", "rollout.batch_size=100000000"],
        r"at least [\d.]+ GiB.*rollout.batch_size=100000000 prompts x rollout.n=2 samples",
    ),
    "paged KV cache larger than memory": (
        ["train", "run.device=cpu", "rollout.engine=paged", "rollout.kv_cache_mb=100000000"],
        r"at least [\d.]+ GiB.*the paged engine's KV cache, rollout.kv_cache_mb=100000000: [\d.]+ GiB",
    ),
    "tokenizer larger than the model": (
        ["train", "model.path={r}/m_small_vocab"],
        r"tokenizer \S*m_small_vocab has 261 token ids.*vocab_size 200 in \S*m_small_vocab/config.json",
    ),
    "other tokenizer larger than the model": (
        ["train", "model.tokenizer={r}/big_tokenizer"],
        r"tokenizer \S*big_tokenizer has 271 token ids.*vocab_size 261 in \S*good/config.json",
    ),
    "tokenizer larger than the model in generate": (
        ["generate", "1+1=", "--model", "{r}/m_small_vocab"],
        r"tokenizer \S*m_small_vocab has 261 token ids",
    ),
    "rows without a data_source": (
        ["train", "data.train_files=[{r}/trl.jsonl]"],
        r"trl.jsonl: row 0 has no data_source.*reward.fn=auto.*found: '' \(2 rows\).*addition, .*reward.fn=",
    ),
    "unknown data_source": (
        ["train", "data.train_files=[{r}/gsm8k.jsonl]"],
        r"gsm8k.jsonl: row 1 has data_source 'gsm8k'.*found: 'addition' \(1 row\), 'gsm8k' \(1 row\)",
    ),
    "unknown data_source in the validation file": (
        ["train", "data.train_files=[{r}/good.jsonl]", "data.val_files=[{r}/gsm8k.jsonl]"],
        r"gsm8k.jsonl: row 1 has data_source 'gsm8k'",
    ),
}
# The cases that need the cluster's resources (run on the local Ray, with reservations forbidden).
ON_RAY = {"more CPUs than the cluster has", "GPUs on a CPU-only cluster", "cuda on a CPU-only cluster"}


def forbidden(*args, **kwargs):
    raise AssertionError("the command got as far as starting Ray or reserving resources for actors")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(the corpus directory with every bad file, a good tiny checkpoint), written once."""
    root = tmp_path_factory.mktemp("bad")
    good = write_tiny_checkpoint(root / "good")
    _write_models(root, good)
    _write_data(root)
    _write_rewards(root)
    _write_recipes(root)
    return root, good


def _model(root: Path, good: Path, name: str, config: dict | None = None) -> Path:
    path = root / name
    shutil.copytree(good, path)
    if config is not None:
        hf = json.loads((good / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**hf, **config}))
    return path


def _write_models(root: Path, good: Path) -> None:
    (_model(root, good, "m_no_config") / "config.json").unlink()
    (_model(root, good, "m_config_text") / "config.json").write_text("{'model_type': qwen2")
    hf = json.loads((good / "config.json").read_text())
    hf.pop("hidden_size")
    (_model(root, good, "m_no_hidden") / "config.json").write_text(json.dumps(hf))
    _model(root, good, "m_gpt2", {"model_type": "gpt2"})
    _model(root, good, "m_gelu", {"hidden_act": "gelu"})
    _model(root, good, "m_sliding", {"use_sliding_window": True, "sliding_window": 32})
    _model(root, good, "m_rope", {"rope_scaling": {"rope_type": "magic", "factor": 2.0}})
    (_model(root, good, "m_no_weights") / "model.safetensors").unlink()
    (_model(root, good, "m_garbage") / "model.safetensors").write_bytes(b"not safetensors at all " * 64)
    weights = (good / "model.safetensors").read_bytes()
    (_model(root, good, "m_truncated") / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    _model(root, good, "m_shapes", {"intermediate_size": 65})
    _model(root, good, "m_layers", {"num_hidden_layers": 3})
    tensors = load_file(str(good / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int8)
    save_file(tensors, str(_model(root, good, "m_int8") / "model.safetensors"))
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "shard-1.safetensors",
            "lm_head.weight": "shard-2.safetensors",
        }
    }
    (_model(root, good, "m_index") / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "m_index" / "shard-1.safetensors").write_bytes(weights)
    _write_vocab_mismatches(root)


def _write_vocab_mismatches(root: Path) -> None:
    """A checkpoint of 200 ids under the 261-id byte tokenizer, and a tokenizer of 271 ids."""
    from helpers import tiny_config

    from tandem.data.tokenizer import build_char_tokenizer
    from tandem.model.checkpoint import save_model
    from tandem.model.decoder import CausalLM

    tokenizer = build_char_tokenizer()
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    save_model(CausalLM(tiny_config(200, **ids)), root / "m_small_vocab")
    tokenizer.save_pretrained(str(root / "m_small_vocab"))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(10)])
    tokenizer.save_pretrained(str(root / "big_tokenizer"))


def _write_data(root: Path) -> None:
    save_rows([{"prompt": "1+1=", "answer": "2", "data_source": "addition"}], str(root / "good.jsonl"))
    (root / "empty.jsonl").write_text("\n")
    save_rows([{"question": "1+1=", "answer": "2"}], str(root / "question.jsonl"))
    save_rows([{"question": "1+1=", "answer": "2"}], str(root / "question.parquet"))
    (root / "malformed.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2=",\n')
    (root / "list_row.jsonl").write_text('["1+1=", "2"]\n')
    (root / "number.jsonl").write_text('{"prompt": 12}\n')
    (root / "no_content.jsonl").write_text('{"prompt": [{"role": "user"}]}\n')
    (root / "extra.jsonl").write_text('{"prompt": "1+1=", "extra_info": "x"}\n')
    (root / "blank.jsonl").write_text('{"prompt": "   "}\n')
    (root / "long.jsonl").write_text(json.dumps({"prompt": "9" * 200}) + "\n")
    (root / "corrupt.parquet").write_bytes(b"PAR1 this is no parquet file")
    (root / "rows.csv").write_text("prompt,answer\n1+1=,2\n")
    (root / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    twice = {
        "twice_first.jsonl": '{"prompt": "1+1=", "prompt": "2+2="}',
        "twice_later.jsonl": '{"prompt": "1+1="}\n\n{"prompt": "2+2=", "answer": 4, "answer": 5}',
        "twice_message.jsonl": '{"prompt": [{"role": "user", "content": "a", "content": ""}]}',
        "twice_array.json": '[{"prompt": "1+1="},\n\n {"prompt": "2+2=", "prompt": "3+3="}]',
    }
    for name, text in twice.items():
        (root / name).write_text(text + "\n")
    save_rows([{"prompt": "1+1=", "solution": "2"}, {"prompt": "2+2=", "solution": "4"}], f"{root}/trl.jsonl")
    rows = [{"prompt": "1+1=", "answer": "2", "data_source": s} for s in ("addition", "gsm8k")]
    save_rows(rows, str(root / "gsm8k.jsonl"))


def _write_rewards(root: Path) -> None:
    (root / "sleepy_rewards.py").write_text(
        "import time\n\ntime.sleep(600)\n\n\n"
        "def score(data_source, solution_str, ground_truth):\n    return 1.0\n"
    )
    (root / "rewards.py").write_text(
        "THRESHOLD = 0.5\n\n\n"
        "def two_args(a, b):\n    return 0.0\n\n\n"
        "def needs_weight(data_source, solution_str, ground_truth, extra_info, weight):\n    return weight\n"
    )
    (root / "syntax.py").write_text("def score(solution_str):\n    return (\n")
    (root / "raises.py").write_text("undefined_name + 1\n")


def _write_recipes(root: Path) -> None:
    (root / "malformed.yaml").write_text("run:\n  steps: [1\n")
    (root / "empty.yaml").write_text("# nothing here yet\n")
    (root / "list.yaml").write_text("- run\n- rollout\n")
    (root / "runs.yaml").write_text("runs:\n  steps: 3\n")
    (root / "scalar.yaml").write_text("sync: 5\n")
    (root / "verl.yaml").write_text("algorithm:\n  adv_estimator: grpo\n")
    (root / "twice.yaml").write_text("run:\n  steps: 3\nrollout:\n  n: 2\nrun:\n  seed: 1\n")
    (root / "twice_nested.yaml").write_text("rollout:\n  n: 4\n  temperature: 1.0\n  n: 2\n")


def command(name: str, root: Path, good: Path) -> list[str]:
    args, _ = CASES[name]
    args = [a.replace("{r}", str(root)).replace("{m}", str(good)) for a in args]
    if args[0] in ("train", "eval"):
        return [args[0], f"model.path={good}", *FAST, f"run.out_dir={root}/runs", *args[1:]]
    return args


def test_the_corpus_is_large_and_every_case_names_what_is_wrong():
    assert len(CASES) >= 60
    assert ON_RAY <= set(CASES)


@pytest.mark.parametrize("name", [n for n in CASES if n not in ON_RAY])
def test_bad_input_before_ray(name, corpus, monkeypatch, capsys):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # even after the Ray cases ran
    monkeypatch.setattr(ray, "init", forbidden)
    monkeypatch.setattr(cluster, "placement_group", forbidden)
    check(name, *corpus, capsys)


@pytest.mark.parametrize("name", sorted(ON_RAY))
@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_bad_input_on_ray(name, corpus, monkeypatch, capsys):
    if "CPU-only" in name and ray.cluster_resources().get("GPU"):
        pytest.skip("the local Ray cluster has a GPU")
    monkeypatch.setattr(cluster, "placement_group", forbidden)
    check(name, *corpus, capsys)


def check(name: str, root: Path, good: Path, capsys) -> None:
    start = time.perf_counter()
    code = main(command(name, root, good))
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(CASES[name][1], err), err
    assert seconds < SECONDS, f"{name}: {seconds:.1f} s"


def test_an_address_where_no_ray_head_answers_fails_within_the_timeout(corpus, monkeypatch, capsys):
    """A port that accepts connections but is no Ray head: Ray would retry it without end."""
    import socket

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", forbidden)
    root, good = corpus
    with socket.create_server(("0.0.0.0", 0)) as server:  # every interface: Ray dials the node's IP
        port = server.getsockname()[1]
        start = time.perf_counter()
        code = main(
            ["train", f"model.path={good}", *FAST, f"run.out_dir={root}/runs"]
            + ["run.timeout_s=2", f"ray.address=127.0.0.1:{port}"]
        )
        seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(rf"ray.address='127.0.0.1:{port}': \S+:{port} accepts connections, but no Ray head", err)
    assert 2 <= seconds < 2 + SECONDS


def test_serve_on_a_busy_port_fails_before_building_its_workers(monkeypatch, capsys):
    """It used to build the workers (~10 s), print its banner, then die of uvicorn's Errno 98, exit 3."""
    import socket

    serve_app = pytest.importorskip("tandem.serve.app")
    monkeypatch.setattr(serve_app, "open_service", forbidden)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what `tandem serve` sets, undone after the test
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        start = time.perf_counter()
        code = main(["serve", "--port", str(port)])
        seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert code == 2 and not out, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(rf"cannot listen on 127.0.0.1:{port}: Address already in use.*another --port", err)
    assert seconds < SECONDS


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"tandem {importlib.metadata.version('tandem')}"


def test_a_prompt_token_past_the_models_vocabulary_names_the_row():
    """Unreachable from the command line while the tokenizer check holds (HF tokenizers number their
    ids 0..len-1), so asked directly: the embedding would raise an IndexError in an actor."""
    limit = PromptLimit(64, vocab_size=100)
    prompts = [Prompt(text="1+1="), Prompt(text="z")]  # byte tokenizer: "z" is id 5 + 122
    with pytest.raises(TandemError, match=r"row 1 of rows.jsonl has the token id 127, past .* 100 ids"):
        limit.encode(build_char_tokenizer(), prompts, "rows.jsonl")


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_one_sample_per_group_is_fine_without_a_group_baseline(estimator):
    check_training(load_config(None, ["rollout.n=1", f"algo.adv_estimator={estimator}"]))


def test_the_recipes_fit_in_a_gibibyte():
    """The memory check refuses only what no machine holds: every training recipe's step, on the
    built-in model with prompts as long as data.max_prompt_length, fits in 1 GiB."""
    model = ModelConfig.load(resolve_model_path("builtin:addition"))
    for recipe in sorted((Path(__file__).parents[1] / "recipes").glob("*.yaml")):
        if not recipe.name.startswith("sim-"):
            cfg = load_config(recipe, ["run.device=cpu"])
            check_memory(cfg, model, [[0] * cfg.data.max_prompt_length], machine=2**30)


def test_a_model_too_large_for_the_machine_is_refused_before_start():
    """A 7B-shaped model's fp32 masters, gradients and AdamW moments (16 bytes a parameter, ~108 GB)
    on a machine of 24 GiB: one paragraph naming the weights, before any worker loads them."""
    shipped = ModelConfig.load(resolve_model_path("builtin:addition"))
    big = dataclasses.replace(
        shipped,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=11008,
        num_hidden_layers=32,
        vocab_size=32000,
    )
    cfg = load_config(None, ["run.device=cpu"])
    with pytest.raises(TandemError, match=r"weights of \d{4}M parameters: 1 train worker\(s\)' fp32 masters"):
        check_memory(cfg, big, [[0] * 8], machine=24 * 2**30)
    check_memory(cfg, shipped, [[0] * 8], machine=24 * 2**30)  # the toy fits


def test_a_recipe_may_merge_a_mapping_and_override_its_keys():
    text = "base: &base {n: 2, top_p: 0.9}\nrollout:\n  <<: *base\n  n: 4\n"
    assert yaml.load(text, Loader=UniqueKeyLoader)["rollout"] == {"n": 4, "top_p": 0.9}
