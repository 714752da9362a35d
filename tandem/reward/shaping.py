"""Reward shaping applied after the verifier: DAPO's soft overlong punishment."""


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens, capped at `max_length`:

        0                                         if L <= L_max - buf
        -(L - (L_max - buf)) / buf * factor       if L_max - buf < L <= L_max
        -factor                                   if L > L_max

    i.e. min(0, -(L - (L_max - buf)) / buf * factor), floored at -factor. A linear ramp over the
    last `buffer` tokens, so a response that runs into the cap is punished more the further into
    the buffer it goes, rather than an abrupt cliff at the cap. buffer=0 turns it off.
    """
    if buffer <= 0:
        return 0.0
    over = length - (max_length - buffer)
    return -min(max(over, 0) / buffer, 1.0) * factor
