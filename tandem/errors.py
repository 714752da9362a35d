"""The one exception type for mistakes a user can fix (bad config, bad data, bad names).

The CLI prints a TandemError as its message alone, with no traceback; anything else is a bug in
tandem and keeps its traceback.
"""


class TandemError(Exception):
    """A user-facing error. The message is one paragraph: what is wrong, where, and what is valid."""
