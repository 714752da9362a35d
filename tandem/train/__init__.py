"""The train worker: logprob recompute, micro-batched loss, optimizer with a non-finite guard."""

from tandem.train.worker import TrainWorker

__all__ = ["TrainWorker"]
