"""The train workers: `worker` (TrainWorker: logprob recompute, micro-batched loss, optimizer with a
non-finite guard), `critic` (PPO's value model), `ref` (reference logprobs), `sft`, and the pieces
they share (`batch`, `optim`, `parallel`, `state`).

This package imports nothing by itself: import each name from its module.
"""
