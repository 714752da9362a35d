"""One decoder (Llama / Qwen2 / Qwen3, dense and MoE) for engine and trainer: `config` (ModelConfig),
`decoder` (CausalLM), `checkpoint` (Hugging Face checkpoint I/O), `logprobs`, `kv_cache`, `paged_kv`;
`builtins` (the `builtin:` names) and `convert` / `gguf` (a GGUF file or checkpoint as one tandem loads).

This package imports nothing by itself, so `tandem.model.config` loads without the decoder:
import each name from its module.
"""
