"""The sequences a session sampled with `record_stability_info=True`, for the training requests that
name them (`tandem.serve.losses.check_provenance`).

As Tinker keeps them: they belong to the session that sampled them, and each may be trained on for
one day after it was sampled; a training request that names it restarts its day. At most `MOST`
are kept in all (the oldest go first), so a client that samples without end holds bounded memory.
"""

import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping

from tandem.serve.losses import Recorded

DAY_S = 24 * 3600.0
MOST = 200_000  # sequences; a few hundred bytes each for short RL responses


class Records:
    def __init__(self, keep_s: float = DAY_S, most: int = MOST, clock=time.monotonic):
        self.keep_s, self.most, self.clock = keep_s, most, clock
        self.kept: OrderedDict[tuple[str, str], tuple[float, Recorded]] = OrderedDict()  # oldest first

    def add(self, session_id: str, sequence_id: str, record: Recorded) -> None:
        self.kept[(session_id, sequence_id)] = (self.clock(), record)
        self.kept.move_to_end((session_id, sequence_id))
        self._expire()

    def of(self, session_id: str) -> Mapping[str, Recorded]:
        """The session's records by sequence id; each one looked up starts its day again."""
        self._expire()
        return _Session(self, session_id)

    def _expire(self) -> None:
        now = self.clock()
        while self.kept and (len(self.kept) > self.most or now - self._oldest() > self.keep_s):
            self.kept.popitem(last=False)

    def _oldest(self) -> float:
        return next(iter(self.kept.values()))[0]


class _Session(Mapping):
    def __init__(self, records: Records, session_id: str):
        self.records, self.session_id = records, session_id

    def __getitem__(self, sequence_id: str) -> Recorded:
        key = (self.session_id, sequence_id)
        _, record = self.records.kept[key]  # KeyError: never recorded in this session, or expired
        self.records.kept[key] = (self.records.clock(), record)
        self.records.kept.move_to_end(key)
        return record

    def __iter__(self) -> Iterator[str]:
        return (sequence for session, sequence in self.records.kept if session == self.session_id)

    def __len__(self) -> int:
        return sum(1 for _ in self)
