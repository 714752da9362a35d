"""Rollout: the engine contract (`base`, `protocol`), the engines (`engine`: builtin, `paged_engine`:
paged, `vllm_engine`: the vLLM adapter) and what the driver may know of them without loading one
(`engines`: names and traits, `vllm_config`), the sampler, and the worker that runs an agent over
an engine (`worker`).

This package imports nothing by itself, so the driver can import `tandem.rollout.group` without
loading a model: import each name from its module.
"""
