"""The driver: one event loop (`loop`) over a cluster (`protocol`), the calls it makes (`calls`),
and what it keeps between them: rollout slots, validation, tail lengths, dynamic sampling, step
statistics, the timeline, checkpoints; and how it recovers (`recovery`: restarts, stops, resume).
No Ray and no model: the Ray shell is `tandem.runtime`, the simulated cluster `tandem.sim`.
"""
