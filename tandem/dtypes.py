"""The dtypes a config may name, and the torch dtype each name means (a leaf: imports only torch)."""

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ROLLOUT_DTYPES = ("auto", *DTYPES)
# float16 training would need loss scaling, which tandem does not do; bf16 has fp32's range.
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
