"""How long an answer to sample or compare: drawn from the alias's own served answers.

Shared by the judge (a group's ``max_tokens``) and the gate (both versions' ``max_tokens``), so a
group and the gate's pairs are cut at the same length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def auto_max_tokens(lengths: Sequence[int], client_cap: int | None, cap: int) -> int:
    """``max_tokens`` from the alias's served answer lengths (``lengths``, in tokens).

    Answers as long as the ones the alias serves, no longer: a constant 256 made a short-answer
    task sample 4x the tokens it needed, and decode time is most of a group's cost. So: 1.25 x
    the 95th percentile (room for a longer answer to be the better one), rounded up to a
    multiple of 16, at least 16; never more than the client itself allowed (``client_cap``),
    nor than ``cap``. Without any served length yet, the most those two bounds allow."""
    limit = cap if client_cap is None else min(cap, client_cap)
    if not lengths:
        return limit
    ordered = sorted(lengths)
    p95 = ordered[math.ceil(0.95 * len(ordered)) - 1]  # nearest rank
    wanted = max(16, math.ceil(1.25 * p95 / 16) * 16)
    return min(limit, wanted)
