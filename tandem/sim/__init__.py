"""`tandem simulate`: the real controller loop and rollout buffer on a virtual clock.

`tandem.sim.cluster` is the discrete-event cluster, `costs` the cost model, `engine` the simulated
continuous-batching engine, `workers` the simulated roles, `lengths` the response lengths,
`run` one simulated run, `compare` the runs of a recipe side by side, `search` the split and
staleness bound that maximise throughput. Nothing here imports Ray. docs/simulate.md.
"""

from tandem.sim.compare import compare
from tandem.sim.search import search

__all__ = ["compare", "search"]
