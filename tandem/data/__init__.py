"""Prompt data: files (`dataset`), synthetic tasks (`tasks`), chat templates (`template`),
tokenizers (`tokenizer`) and the batches the driver takes (`loader`).

This package imports nothing by itself (a tokenizer loads transformers): import each name from its
module.
"""
