"""The search of :func:`ac_policies.fit.fit`: choices per block, the cost/saving frontier over
blocks (a dynamic programme), the candidate tables and the cheapest one verified within the budget
(steps 2-4 of ``fit``'s docstring). Pure bookkeeping: measuring is the caller's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from .rules import Rule

#: A recompute cost: (FLOPs, op calls), compared in that order.
Cost = tuple[int, int]
#: Resolution of the dynamic programme: savings in 1/_BUCKETS of the peak without checkpointing.
_BUCKETS = 256
#: Predicted peaks may undershoot by the recompute transient: try entries predicted up to this far over.
_MARGIN = 0.10
#: At most this many candidate tables are measured per fit.
_MAX_VERIFIED = 48


@dataclasses.dataclass(frozen=True)
class Choice:
    """One way to treat a block: ``(path relative to the block, action)`` pairs ('' = the block)."""

    parts: tuple[tuple[str, str], ...]

    @property
    def block_level(self) -> bool:
        return len(self.parts) == 1 and self.parts[0][0] == ""

    def rules(self, block: str) -> list[Rule]:
        return [Rule(match=f"{block}.{path}" if path else block, action=action) for path, action in self.parts]


@dataclasses.dataclass(frozen=True)
class Option:
    """A measured choice: bytes it saves at the step peak; its recompute cost (FLOPs, op calls)."""

    choice: Choice
    saved: int
    cost: Cost


def useful(options: list[Option]) -> list[Option]:
    """Options that save something, without one that saves at least as much for no more FLOPs."""
    kept = []
    for o in sorted(options, key=lambda o: (o.cost, -o.saved)):
        if o.saved > 0 and all(o.saved > k.saved for k in kept):
            kept.append(o)
    return kept


def _frontier(per_block: list[list[Option]], quantum: int) -> list[tuple[Cost, int, tuple[Optional[Option], ...]]]:
    """``(cost, saved, one option or None per block)`` on the cost/saving frontier, cheapest first."""
    states: dict[int, tuple[Cost, int, tuple]] = {0: ((0, 0), 0, ())}  # bucket -> (cost, saved, picks)
    for options in per_block:
        nxt: dict[int, tuple[Cost, int, tuple]] = {}
        for cost, saved, picks in states.values():
            for o in [None, *options]:
                c = (cost[0] + o.cost[0], cost[1] + o.cost[1]) if o else cost
                s = saved + (o.saved if o else 0)
                key = s // quantum
                if key not in nxt or (c, -s) < (nxt[key][0], -nxt[key][1]):
                    nxt[key] = (c, s, picks + (o,))
        states = nxt
    front, best = [], -1
    for cost, saved, picks in sorted(states.values(), key=lambda x: (x[0], -x[1])):
        if saved > best:
            front.append((cost, saved, picks))
            best = saved
    return front


def _rules(blocks: list[str], picks: tuple[Optional[Option], ...]) -> list[Rule]:
    return [rule for fqn, o in zip(blocks, picks) if o is not None for rule in o.choice.rules(fqn)]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A whole table: its rules, predicted recompute cost and saving, and the option per block."""

    rules: tuple[Rule, ...]
    cost: Cost
    saved: int
    picks: tuple[Optional[Option], ...]


def candidates(blocks: list[str], per_block: list[list[Option]], peak0: int) -> list[Candidate]:
    """The frontier of mixed tables and that of block-level tables, cheapest first (the one that
    saves the most last)."""
    quantum = max(1, peak0 // _BUCKETS)
    front = _frontier(per_block, quantum)
    block_level = _frontier([[o for o in opts if o.choice.block_level] for opts in per_block], quantum)
    found: dict[tuple[Rule, ...], Candidate] = {}
    for cost, saved, picks in [*front, *block_level]:
        picks = _earliest_first(per_block, picks)
        rules = tuple(_rules(blocks, picks))
        found.setdefault(rules, Candidate(rules, cost, saved, picks))
    ordered = sorted(found.values(), key=lambda c: (c.cost, -c.saved))
    most = max(ordered, key=lambda c: (c.saved, [-x for x in c.cost]))
    return [c for c in ordered if c is not most] + [most]


def _earliest_first(per_block: list[list[Option]], picks: tuple[Optional[Option], ...]) -> tuple[Optional[Option], ...]:
    """``picks`` rearranged among blocks of one kind (same options) so that earlier blocks get the
    choices that save more. Costs and predicted savings do not change; the measured peak does:
    backward recomputes a late block while the activations of every earlier block are still held,
    so the saving belongs early and the blocks left whole belong last."""
    out = list(picks)
    kinds: dict[int, list[int]] = {}
    for i, options in enumerate(per_block):
        kinds.setdefault(id(options), []).append(i)
    for positions in kinds.values():
        ranked = sorted((out[i] for i in positions), key=lambda o: -(o.saved if o else 0))
        for i, o in zip(positions, ranked):
            out[i] = o
    return tuple(out)


def select(candidates: list[Candidate], peak0: int, limit: int,
            peak_of: Callable[[Candidate], int]) -> tuple[Optional[Candidate], int]:
    """The cheapest candidate whose measured peak (``peak_of``) is within ``limit``, and how many
    were measured; None when even the one that saves the most (the last) is over the limit.

    Candidates predicted (``peak0 - saved``) more than :data:`_MARGIN` over the limit are not
    measured. That set only grows with the limit, and candidates are tried cheapest first, so a
    larger limit never gives a costlier table (up to :data:`_MAX_VERIFIED` measurements, after
    which the one that saves the most is taken).
    """
    most = candidates[-1]
    if peak_of(most) > limit:
        return None, 1
    verified = 1
    for candidate in candidates[:-1]:
        if peak0 - candidate.saved > limit * (1 + _MARGIN):
            continue
        if verified > _MAX_VERIFIED:
            break
        verified += 1
        if peak_of(candidate) <= limit:
            return candidate, verified
    return most, verified
