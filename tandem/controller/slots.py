"""The rollout workers' slots: generate calls each holds, and which are being re-synced after a restart."""

MAX_RESYNC_TRIES = 3  # a restarted worker whose re-sync fails more often ends the run


class RolloutSlots:
    def __init__(self, workers: int, per_worker: int):
        """per_worker: generate calls handed to one worker at a time (rollout.calls_per_worker)."""
        self.per_worker = per_worker
        self.queued = [0] * workers  # generate / val calls outstanding per worker
        self.syncing = [False] * workers  # a worker being re-synced gets no work
        self.tries = [0] * workers  # re-syncs since the worker last held the newest weights

    def pick(self) -> int | None:
        """The least loaded worker with a free slot that is not re-syncing, or None."""
        free = [i for i, q in enumerate(self.queued) if q < self.per_worker and not self.syncing[i]]
        return min(free, key=lambda i: self.queued[i]) if free else None

    def took(self, i: int) -> None:
        self.queued[i] += 1

    def returned(self, i: int) -> None:
        self.queued[i] -= 1

    def restarting(self, i: int) -> bool:
        """Worker `i` died and restarts: no work until it is re-synced. False once it has failed
        to come back MAX_RESYNC_TRIES times."""
        self.syncing[i] = True
        self.tries[i] += 1
        return self.tries[i] <= MAX_RESYNC_TRIES

    def resynced(self, i: int) -> None:
        self.syncing[i], self.tries[i] = False, 0

    def __str__(self) -> str:
        return f"queued calls {self.queued}, syncing {self.syncing}"
