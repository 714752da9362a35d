"""ModelConfig: the decoder's shape, read from and written to a Hugging Face `config.json`."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem.errors import TandemError
from tandem.model.rope import check_scaling

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral")
# Mixture-of-experts fields written back to config.json, per family (the rest are tandem's own).
MOE_FIELDS = {
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers"),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
}  # fmt: skip


@dataclass
class ModelConfig:
    """The Llama / Qwen2 / Qwen3 family differ only in these switches.

    qwen2: bias on q/k/v only. qwen3: q/k RMSNorm over the head dim, `attention_bias` on all four
    projections. llama: `attention_bias` on all four, optional `mlp_bias`. The MoE variants
    (qwen2_moe, qwen3_moe, mixtral: attention as qwen2, qwen3, llama) replace the MLP of the layers
    `moe_layers` names with `num_experts` routed experts (`num_experts_per_tok`
    per token, `moe_intermediate_size` wide), Qwen2-MoE's with a gated shared expert beside them.
    """

    model_type: str = "qwen2"
    vocab_size: int = 128
    hidden_size: int = 256
    intermediate_size: int = 640
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None: plain RoPE. Else the checkpoint's rope_parameters without rope_theta, e.g.
    # {"rope_type": "llama3", "factor": 8.0, ...}: see tandem.model.rope for the types.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    qkv_bias: bool = True
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0  # 0 = dense
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # qwen2_moe; 0 = no shared expert
    norm_topk_prob: bool = False  # renormalise the top-k weights (mixtral always does)
    decoder_sparse_step: int = 1  # every step-th layer is sparse...
    mlp_only_layers: list[int] = field(default_factory=list)  # ...except these
    # Not in config.json: the run's model.router_dtype. float32 | model (the compute dtype).
    router_dtype: str = "float32"

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise TandemError(
                f"{source}: model_type {model_type!r} is not supported. "
                f"Valid model types: {', '.join(ARCHITECTURES)}."
            )
        _check_shape_fields(hf, source)
        _refuse_what_changes_the_computation(hf, source)
        # rope_scaling (the older spelling) wins when both are there, as in transformers.
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        family = {"qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "mixtral": "llama"}.get(model_type, model_type)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(hf, rope, source),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(hf, family, attention_bias),
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=family == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            **(_moe_fields(hf, source) if model_type in MOE_TYPES else {}),
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json that `transformers.AutoConfig` reads back into the same model."""
        internal = ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "rope_scaling", "router_dtype")
        moe = (*MOE_FIELDS["qwen2_moe"], "num_local_experts")
        hf = {k: v for k, v in asdict(self).items() if k not in internal and k not in moe}
        for name in MOE_FIELDS.get(self.model_type, ()):
            hf[name] = self.num_experts if name == "num_local_experts" else getattr(self, name)
        hf["architectures"] = [ARCHITECTURES[self.model_type]]
        hf["hidden_act"] = "silu"
        # Both spellings: transformers>=5 reads rope_parameters, older versions rope_theta and rope_scaling.
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            hf["rope_parameters"] = {**self.rope_scaling, "rope_theta": self.rope_theta}
            hf["rope_scaling"] = dict(self.rope_scaling)
        hf["torch_dtype"] = "float32"
        if self.model_type not in ("qwen2", "qwen2_moe"):
            hf["attention_bias"] = self.o_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.model_type == "qwen2_moe":
            hf["qkv_bias"] = self.qkv_bias
        return hf

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise TandemError(f"No config.json in {path}: a model is a Hugging Face checkpoint directory.")
        try:
            hf = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TandemError(f"{file} is not valid JSON: {e}.") from None
        if not isinstance(hf, dict):
            raise TandemError(f"{file} must hold a JSON object, not a {type(hf).__name__}.")
        return cls.from_hf(hf, source=str(file))


def _qkv_bias(hf: dict[str, Any], family: str, attention_bias: bool) -> bool:
    """Qwen2's q/k/v always have a bias; Qwen2-MoE's only with `qkv_bias` (default true, transformers>=5)."""
    if hf["model_type"] == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return True if family == "qwen2" else attention_bias


def _moe_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The MoE fields of an MoE config.json, checked; TandemError naming what tandem cannot run."""
    for name in ("router_jitter_noise",):  # Mixtral's: multiplies the input by noise in training
        if hf.get(name):
            raise TandemError(
                f"{source}: {name}={hf[name]} is not supported: it makes the training forward random "
                "(the trainer's logprobs would differ from the engine's on every token). Set it to 0."
            )
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    per_token = hf.get("num_experts_per_tok")
    for name, value in (("num_experts", experts), ("num_experts_per_tok", per_token)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TandemError(f"{source}: {name} is {value!r}; an MoE model needs a positive integer.")
    if per_token > experts:
        raise TandemError(f"{source}: num_experts_per_tok={per_token} exceeds the {experts} experts.")
    mixtral = hf["model_type"] == "mixtral"
    if mixtral and hf.get("sliding_window"):
        raise TandemError(
            f"{source}: sliding_window={hf['sliding_window']} is not supported; tandem's attention is "
            "full causal attention on every layer."
        )
    step = hf.get("decoder_sparse_step", 1)
    if not mixtral and (not isinstance(step, int) or isinstance(step, bool) or step < 1):
        raise TandemError(
            f"{source}: decoder_sparse_step is {step!r}; it must be a positive integer (every "
            "decoder_sparse_step-th layer is a mixture of experts)."
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_size=hf["intermediate_size"] if mixtral else hf["moe_intermediate_size"],
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0) or 0,
        norm_topk_prob=True if mixtral else bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=1 if mixtral else step,
        mlp_only_layers=[] if mixtral else list(hf.get("mlp_only_layers") or []),
    )


def _rope_scaling(hf: dict[str, Any], rope: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The checkpoint's RoPE parameters less rope_theta, with the defaults transformers fills in;
    None for plain RoPE. TandemError naming the rope type if tandem cannot compute it."""
    params = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")}
    params["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if "partial_rotary_factor" in hf:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if params["rope_type"] == "default":
        return None
    if params["rope_type"] in ("llama3", "yarn"):
        # A top-level original_max_position_embeddings (Phi-3 style) wins, as in transformers.
        original = hf.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 2048))
    check_scaling(params, source)
    return params


SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_shape_fields(hf: dict[str, Any], source: str) -> None:
    """The fields that size the decoder are there and positive integers (the optional ones too)."""
    for name in SHAPE_FIELDS + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = hf.get(name)
        if value is None and name not in SHAPE_FIELDS:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            what = "missing" if name not in hf else f"{value!r}"
            raise TandemError(f"{source}: {name} is {what}; it must be a positive integer.")
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    if heads % kv:
        raise TandemError(f"{source}: num_key_value_heads={kv} must divide num_attention_heads={heads}.")
    if not hf.get("head_dim") and hf["hidden_size"] % heads:
        raise TandemError(
            f"{source}: hidden_size={hf['hidden_size']} is not divisible by num_attention_heads={heads} "
            "and there is no head_dim."
        )


def _refuse_what_changes_the_computation(hf: dict[str, Any], source: str) -> None:
    """Config fields this decoder does not implement, refused by name rather than loaded as a
    model that computes something else (logits 0.8-6 away from transformers')."""
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise TandemError(
            f"{source}: hidden_act={act!r} is not supported; tandem's decoder implements SiLU (swish) "
            "MLPs only, as Llama, Qwen2 and Qwen3 use."
        )
    kinds = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
    if kinds:
        raise TandemError(
            f"{source}: layer_types has {', '.join(map(repr, kinds))} layers; tandem's attention is "
            "full causal attention on every layer, so only 'full_attention' is supported."
        )
    if hf.get("use_sliding_window"):
        raise TandemError(
            f"{source}: use_sliding_window=true (sliding_window={hf.get('sliding_window')}) is not "
            "supported; tandem's attention is full causal attention on every layer."
        )


def resolve_model_path(spec: str, key: str = "") -> Path:
    """The checkpoint directory `spec` (the config's `key`, named in errors) names: a local
    directory, "builtin:<name>" (a warm start shipped in tandem/assets, or a published model
    converted once into the cache: `tandem.model.builtins` lists them), or a Hugging Face hub id
    ORG/NAME[@REVISION] that is no local path, fetched into huggingface_hub's cache
    (`tandem.model.hub`)."""
    # Here, not at the top: the simulator reads this module for shapes and loads no converter or hub.
    if spec.startswith("builtin:"):
        from tandem.model.builtins import builtin_path

        return builtin_path(spec.split(":", 1)[1], ModelConfig.from_hf)
    from tandem.model.hub import hub_id, snapshot

    if (found := hub_id(spec)) is not None:
        return snapshot(*found, spec, key)
    return Path(spec)


def model_dir(spec: str, key: str = "model.path") -> Path:
    """The checkpoint directory `spec` (the config's `key`) names (resolved as `resolve_model_path`
    does), or a TandemError."""
    path = resolve_model_path(spec, key)
    if path.is_file() and path.stat().st_size < 256:  # a run's `latest`: the name of its newest checkpoint
        named = path.parent / path.read_text(errors="replace").strip()
        if named.is_dir() and named != path.parent:
            raise TandemError(
                f"Model path {path} ({key}) is a file naming the run's newest checkpoint: give that "
                f"checkpoint's directory, {named}."
            )
    if not path.is_dir():
        raise TandemError(f"Model path {path} ({key}) does not exist or is not a directory.")
    return path


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The indices of the layers whose feed-forward is a `SparseMoE` (`tandem.model.experts`); the
    rest are dense."""
    if not cfg.num_experts:
        return []
    sparse = [(i + 1) % cfg.decoder_sparse_step == 0 for i in range(cfg.num_hidden_layers)]
    return [i for i, s in enumerate(sparse) if s and i not in cfg.mlp_only_layers]
