"""The longest context that fits a memory budget, found by measuring: doubling, then bisection.

:func:`longest_fitting` is the search, pure: it asks ``fits(tokens)`` (in the ``train`` section,
one training run of one row of that many tokens in its own process, whose measured step peak is
compared with the budget) and never extrapolates. :func:`parse_budget` reads ``--train-budget``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


@dataclasses.dataclass(frozen=True)
class Search:
    """``longest``: the longest length that fitted (None: not even ``start``); ``probes``: every
    ``(length, fitted)`` asked, in order; ``at_limit``: ``longest`` is the search's limit (the
    true answer may be longer)."""

    longest: Optional[int]
    probes: tuple[tuple[int, bool], ...]
    at_limit: bool

    def describe(self) -> str:
        if self.longest is None:
            return "nothing fits"
        return f">= {self.longest} (search limit)" if self.at_limit else str(self.longest)


def longest_fitting(fits: Callable[[int], bool], start: int, limit: int, granularity: int,
                    tolerance: float = 0.25) -> Search:
    """The longest ``n`` in ``start..limit`` with ``fits(n)``, assuming that fitting is monotone.

    Doubles from ``start`` until a length does not fit (or ``limit``, probed itself when the
    doubling passes it), then bisects between the last fit and the first miss, on multiples of
    ``granularity``, until they are at most ``max(granularity, tolerance * fit)`` apart.

    Raises:
        ValueError: ``start``, ``limit`` or ``granularity`` not positive, or ``limit < start``.
    """
    if min(start, limit, granularity) <= 0 or limit < start:
        raise ValueError(f"need 0 < start <= limit and granularity > 0, got start={start}, limit={limit}, "
                         f"granularity={granularity}")
    probes: list[tuple[int, bool]] = []

    def ask(n: int) -> bool:
        ok = bool(fits(n))
        probes.append((n, ok))
        return ok

    if not ask(start):
        return Search(None, tuple(probes), False)
    lo, hi = start, None
    while hi is None and lo < limit:
        n = min(2 * lo, limit)
        if ask(n):
            lo = n
        else:
            hi = n
    if hi is None:
        return Search(lo, tuple(probes), True)
    while hi - lo > max(granularity, tolerance * lo):
        mid = lo + ((hi - lo) // 2 // granularity) * granularity
        if mid <= lo:
            break
        if ask(mid):
            lo = mid
        else:
            hi = mid
    return Search(lo, tuple(probes), False)


@dataclasses.dataclass(frozen=True)
class Budget:
    """A memory budget: ``bytes`` in all, or (``above_static``) on top of the static state."""

    bytes: int
    above_static: bool

    def limit_above_static(self, static: int) -> int:
        """What the step may hold beyond parameters, gradients and optimizer state."""
        return self.bytes if self.above_static else self.bytes - static

    def describe(self, static: Optional[int] = None) -> str:
        size = _size(self.bytes)
        if not self.above_static:
            return size
        total = "" if static is None else f" = {_size(static + self.bytes)} in all"
        return f"static state + {size}{total}"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def parse_budget(text: str) -> Budget:
    """``"6GiB"`` (everything the step holds) or ``"+1GiB"`` (on top of parameters, gradients and
    optimizer state); units B, KB, MB, GB, KiB, MiB, GiB. ``ValueError`` for anything else."""
    m = re.fullmatch(r"\s*(\+?)\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(3).lower() not in _UNITS:
        raise ValueError(f"a budget is a size such as '6GiB' or '+1GiB' (on top of the static state), got {text!r}")
    value = float(m.group(2)) * _UNITS[m.group(3).lower()]
    if value <= 0:
        raise ValueError(f"a budget must be positive, got {text!r}")
    return Budget(int(value), above_static=m.group(1) == "+")
