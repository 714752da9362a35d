"""The train workers: `worker` (TrainWorker: π_old, advantages and the policy's loss), `critic`
(PPO's value model and its loss), each on a `learner` (Learner: fp32 master weights, parallelism,
gradient accumulation, optimizer with a non-finite guard, its state); `ref` (reference logprobs),
`sft`, and the pieces they share (`batch`, `optim`, `parallel`, `state`).

This package imports nothing by itself: import each name from its module.
"""
