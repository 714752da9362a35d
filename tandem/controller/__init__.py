"""The controller: placement of roles on Ray, the modes' event loop, validation, metrics, timeline.

Ray is imported only when a run starts, so `tandem.controller.placement` and friends load without it.
"""


def run_training(cfg, on_step=None) -> dict[str, float]:
    """See `tandem.controller.run.run_training`."""
    from tandem.controller.run import run_training as run

    return run(cfg, on_step)


__all__ = ["run_training"]
