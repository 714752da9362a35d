"""The cost model: how long each simulated call takes, from the model's shape and the hardware's figures.

All times are full-speed seconds (a worker sharing its devices beyond their capacity runs slower:
`tandem.sim.cluster`). One formula per kind of work, the same for every configuration:

    decode step   max(W_n / (d·BW·e), 2·P_a·n / (d^γ·F·m_dec)) + C·kv / (d·BW·e_kv) + o + 2·L·a·[d > 1]
    prefill       t tokens: 2·P_a·t / (d^γ·F·m_pre)
    train step    tokens·(6·P_a + attn)·r / R(G, m_train) + updates·u, and a π_old forward
                  tokens·(2·P_a + attn) / R(G, m_fwd) where the trainer recomputes it
    trainer rate  R(G, m) = G·F·m·s(G)·η_c,  s(G) = (G / G_ref)^(β - 1)
    weight push   o_sync + W / link (a trainer on other devices), W / local (colocated)
    sleep, wake   s_sleep + W / offload, s_wake + W / offload (a colocated engine, each train step)

W the weights' bytes (every parameter: they also bound the KV cache), P_a the parameters a token
computes with, W_n the bytes a decode step of n sequences reads (a dense model: P_a = all of them,
W_n = W; a mixture of experts: its dense part and k of its E experts, and the dense part and
min(E, n·k) experts: `Shape`), n running sequences, C their summed context (tokens), kv bytes of
keys and values per context token, d devices of an engine (tensor parallel), G of the trainer, BW
memory bandwidth, F peak FLOP/s, e and m the fractions of them achieved (e_kv reading the KV cache,
e unless set), o a decode step's fixed
cost (launches, sampling, scheduling), a one all-reduce's latency (2 per layer under tensor
parallelism), r 4/3 with activation checkpointing (else 1), u an optimizer update's own cost,
γ how an engine's compute grows with its devices (1 for tensor parallelism on GPUs; CPU threads
less). s(G) is data-parallel training's per-device efficiency: one power law over every trainer
size, 1 at G_ref devices, above 1 on fewer (less communication per FLOP), below 1 on more; the
trainer's throughput grows as G^β. η_c is 1 for a trainer on devices of its own and
`colocated_train_efficiency` for one that time-shares them with sleeping rollout engines (no
part-level figure exists: the shipped calibrations leave it at 1, docs/simulate.md). Every call a worker
starts before `startup_s` into the run waits until then (`tandem.sim.workers.TimedWorker`). The
figures come from a calibration file (recipes/sim-calibration-*.yaml, or `tandem simulate
--calibrate`: tandem.sim.calibrate), each with its source.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem.errors import TandemError
from tandem.model.config import ModelConfig, moe_layers


@dataclass
class Calibration:
    """One device's figures (a GPU, or a CPU core) and the software's achieved fractions of them."""

    device: str = "unnamed"
    peak_flops: float = 1e12  # dense FLOP/s of one device in the compute dtype
    memory_bytes_per_s: float = 1e11  # memory bandwidth of one device
    memory_bytes: float = 16e9  # memory of one device
    bytes_per_param: float = 2.0  # the engines' weights (2 = bf16, 4 = fp32)
    kv_bytes_per_value: float = 2.0  # the engines' KV cache
    bandwidth_efficiency: float = 0.8  # e: of memory bandwidth, reading weights and KV in decode
    # e_kv: the same for the KV cache alone where it differs (a CPU's attention is not bandwidth-bound);
    # 0 = bandwidth_efficiency
    kv_bandwidth_efficiency: float = 0.0
    decode_mfu: float = 0.5  # m_dec: of peak FLOP/s in a compute-bound decode step
    prefill_mfu: float = 0.5  # m_pre
    decode_step_overhead_s: float = 0.0  # o
    engine_scaling_exponent: float = 1.0  # γ: an engine's FLOP/s grow as devices^γ
    allreduce_latency_s: float = 0.0  # a
    train_mfu: float = 0.4  # m_train: forward + backward, on train_scaling_ref devices of its own
    forward_mfu: float = 0.4  # m_fwd: a forward-only pass (π_old, reference logprobs, values), likewise
    train_scaling_ref: int = 1  # G_ref
    train_scaling_exponent: float = 1.0  # β: trainer throughput ∝ G^β, at every G
    colocated_train_efficiency: float = 1.0  # η_c: a trainer sharing its devices with sleeping engines
    activation_checkpointing: bool = False  # r = 4/3: the forward runs again in the backward
    optimizer_update_s: float = 0.0  # u: one optimizer update's step and gradient communication
    link_bytes_per_s: float = 1e10  # a weight push between the trainer's devices and an engine's
    local_copy_bytes_per_s: float = 1e11  # a weight push onto the same devices (colocated)
    sync_latency_s: float = 0.0  # o_sync: a push's fixed cost
    sleep_s: float = 0.0  # a colocated engine freeing its memory for the train step, fixed part
    wake_s: float = 0.0  # and taking it back for the next generation, fixed part
    offload_bytes_per_s: float = 0.0  # each also moves the weights at this rate (0: no per-byte part)
    call_s: float = 0.0  # the driver's cost per call (dispatch, serialization)
    startup_s: float = 0.0  # a worker's start (process, imports, model) before its first call
    reward_s_per_sample: float = 0.0  # the verifier's time per sample
    # CPUs: threads of two workers on the same cores slow down more than their share, as their
    # barrier-synchronised matmuls wait for descheduled threads: speed = (cap / demand)^this.
    oversubscription_exponent: float = 1.0

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        if not p.is_file():
            raise TandemError(
                f"Config 'sim.calibration': {p} does not exist. The shipped ones are "
                "recipes/sim-calibration-*.yaml."
            )
        tree = yaml.safe_load(p.read_text()) or {}
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in tree.items():
            if key not in known:
                raise TandemError(f"{p}: unknown key {key!r}. Valid keys: {', '.join(known)}.")
            want = known[key].type
            if want in (float, int) and isinstance(value, str):
                try:  # YAML reads 1e12 (no dot, no sign) as a string; it is plainly a number
                    value = float(value)
                except ValueError:
                    pass
            if want is bool and not isinstance(value, bool):
                raise TandemError(f"{p}: {key} must be true or false, got {value!r}.")
            if want in (float, int) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TandemError(f"{p}: {key} must be a number, got {value!r}.")
            if want in (float, int) and value < 0:
                raise TandemError(f"{p}: {key} must be >= 0, got {value!r}.")
            if want is str and not isinstance(value, str):
                raise TandemError(f"{p}: {key} must be a string, got {value!r}.")
            values[key] = value
        cal = cls(**values)
        for key in ("peak_flops", "memory_bytes_per_s", "bandwidth_efficiency", "decode_mfu", "prefill_mfu"):
            if getattr(cal, key) <= 0:
                raise TandemError(f"{p}: {key} must be > 0.")
        for key in (
            "train_mfu",
            "forward_mfu",
            "train_scaling_exponent",
            "engine_scaling_exponent",
            "colocated_train_efficiency",
        ):
            if not 0 < getattr(cal, key) <= 1:
                raise TandemError(f"{p}: {key} must be in (0, 1].")
        return cal


@dataclass
class Shape:
    """What the cost model needs of a decoder. A mixture of experts' routed experts are
    `expert_params` each (one expert's weights over every MoE layer), `experts_per_token` of its
    `experts` used per token; the rest (attention, embeddings, dense MLPs, routers, shared experts)
    every token uses. A dense model has no experts: active_params == params."""

    params: float  # P: every parameter (weight bytes, KV capacity, pushes, offload)
    layers: int
    q_dim: int  # query heads x head dim (Qwen3's head dim is not hidden / heads)
    kv_dim: int  # key/value heads x head dim
    experts: int = 0  # E
    experts_per_token: int = 0  # k
    expert_params: float = 0.0

    @property
    def active_params(self) -> float:
        """P_a: the parameters one token computes with (every FLOP formula)."""
        return self.params - (self.experts - self.experts_per_token) * self.expert_params

    def params_read(self, n: int) -> float:
        """The parameters a decode step of n sequences reads: the dense part and min(E, n·k) experts
        (n·k routed tokens touch at most that many; past E, every expert once)."""
        unread = max(self.experts - n * self.experts_per_token, 0)
        return self.params - unread * self.expert_params

    @classmethod
    def of(cls, c: ModelConfig) -> "Shape":
        """From a model's config: weight matrices only (norms and biases are noise)."""
        h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        sparse = len(moe_layers(c))
        attn = c.num_hidden_layers * (h * (q + 2 * kv) + q * h)
        mlp = (c.num_hidden_layers - sparse) * 3 * h * c.intermediate_size
        # per MoE layer: the router, and a shared expert with its one-row gate (Qwen2-MoE)
        shared = 3 * h * c.shared_expert_intermediate_size + (h if c.shared_expert_intermediate_size else 0)
        routers = sparse * (h * c.num_experts + shared)
        expert = sparse * 3 * h * c.moe_intermediate_size
        embed = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
        dense = attn + mlp + routers + embed
        e, k = (c.num_experts, c.num_experts_per_tok) if sparse else (0, 0)
        return cls(float(dense + e * expert), c.num_hidden_layers, q, kv, e, k, float(expert))


class Costs:
    """The formulas of the module docstring for one model on one calibration."""

    def __init__(self, shape: Shape, cal: Calibration):
        self.shape, self.cal = shape, cal
        self.weight_bytes = shape.params * cal.bytes_per_param
        self.kv_bytes_per_token = 2 * shape.layers * shape.kv_dim * cal.kv_bytes_per_value

    # -- an engine on `d` devices --------------------------------------------------------------------
    def decode_step_fixed(self, n: int, d: float) -> float:
        """The part of a decode step of n sequences that does not grow with their context."""
        c = self.cal
        read = self.shape.params_read(n) * c.bytes_per_param
        weights = read / (d * c.memory_bytes_per_s * c.bandwidth_efficiency)
        flops = 2 * self.shape.active_params * n / self._engine_rate(d, c.decode_mfu)
        tp = 2 * self.shape.layers * c.allreduce_latency_s if d > 1 else 0.0
        return max(weights, flops) + c.decode_step_overhead_s + tp

    def kv_s_per_token(self, d: float) -> float:
        """A decode step's time per token of context it reads (keys and values, every layer)."""
        c = self.cal
        return self.kv_bytes_per_token / (
            d * c.memory_bytes_per_s * (c.kv_bandwidth_efficiency or c.bandwidth_efficiency)
        )

    def prefill_s(self, tokens: float, d: float) -> float:
        return 2 * self.shape.active_params * tokens / self._engine_rate(d, self.cal.prefill_mfu)

    def _engine_rate(self, d: float, mfu: float) -> float:
        """d^γ·F·m: the FLOP/s an engine on d devices achieves at `mfu` of one device's peak."""
        return d**self.cal.engine_scaling_exponent * self.cal.peak_flops * mfu

    def kv_capacity_tokens(self, d: float, memory_fraction: float) -> float:
        """Tokens of context an engine holds: its share of the devices' memory less the weights."""
        free = d * self.cal.memory_bytes * memory_fraction - self.weight_bytes
        return max(free, 0.0) / self.kv_bytes_per_token

    # -- a trainer on G devices ----------------------------------------------------------------------
    def forward_flops(self, lengths: list[int]) -> float:
        """A forward pass over whole sequences of these lengths: 2·P_a per token, and causal
        self-attention's matmuls, 2·L·q·len² each (q the query heads' width)."""
        attention = sum(2.0 * self.shape.layers * self.shape.q_dim * n * n for n in lengths)
        return 2 * self.shape.active_params * sum(lengths) + attention

    def train_rate(self, g: float, mfu: float, colocated: bool = False) -> float:
        """R(G, m): FLOP/s a trainer on g devices achieves, `mfu` being its fraction of peak on
        train_scaling_ref devices of its own."""
        c = self.cal
        shared = c.colocated_train_efficiency if colocated else 1.0
        return g * c.peak_flops * mfu * (g / c.train_scaling_ref) ** (c.train_scaling_exponent - 1) * shared

    def forward_s(self, lengths: list[int], g: float, colocated: bool = False) -> float:
        """A forward pass (π_old, reference logprobs, values) over sequences of these lengths."""
        return self.forward_flops(lengths) / self.train_rate(g, self.cal.forward_mfu, colocated)

    def train_s(self, lengths: list[int], g: float, updates: int, colocated: bool = False) -> float:
        """Forward and backward over every sequence, and `updates` optimizer updates."""
        redo = 4 / 3 if self.cal.activation_checkpointing else 1.0
        flops = 3 * self.forward_flops(lengths) * redo
        rate = self.train_rate(g, self.cal.train_mfu, colocated)
        return flops / rate + updates * self.cal.optimizer_update_s

    # -- a colocated engine's sleep and wake -------------------------------------------------------
    def sleep_s(self) -> float:
        """s_sleep + W / offload: vLLM's sleep mode copies the weights out (level 1)."""
        return self.cal.sleep_s + self._offload_s()

    def wake_s(self) -> float:
        """s_wake + W / offload: and back in."""
        return self.cal.wake_s + self._offload_s()

    def _offload_s(self) -> float:
        rate = self.cal.offload_bytes_per_s
        return self.weight_bytes / rate if rate > 0 else 0.0

    # -- weights from the trainer to an engine ---------------------------------------------------------
    def push_s(self, colocated: bool) -> float:
        c = self.cal
        rate = c.local_copy_bytes_per_s if colocated else c.link_bytes_per_s
        return c.sync_latency_s + self.weight_bytes / rate

    def pack_s(self) -> float:
        """The trainer's side of a push: gathering the weights into buckets."""
        return self.weight_bytes / self.cal.local_copy_bytes_per_s
