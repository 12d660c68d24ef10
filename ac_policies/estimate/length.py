"""Estimates at a long sequence from three shorter ones: the step's bytes as a quadratic in tokens.

Past a few thousand tokens every byte count of a training step is a low-degree polynomial in the
sequence length: parameters, gradients and optimizer state do not depend on it; what forward keeps
and each phase's working set are per token (linear) once ``tile`` slices have their full size and
the loss's chunks theirs; a dense ``[tokens, tokens]`` mask or eager attention's scores are
quadratic. So the estimate at a long length is predicted from three traced lengths by the quadratic
through them, phase by phase (the step's peak is the largest phase's, as in
:func:`~ac_policies.estimate.depth.extrapolate`). :func:`predicts` says whether a run of traces is
in that regime: the quadratic through three of them predicts the next within a tolerance. This is
what keeps :func:`~ac_policies.longest_context` fast at a million tokens, where one trace holds a
few hundred slices per tiled module: the search traces the lengths it jumps over only when the
prediction is not trusted, and always traces its answer.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .result import MemoryEstimate

__all__ = ["TOLERANCE", "predict", "predicts"]

#: How close (relative to the traced step peak) every phase's predicted peak must be to the traced
#: one for :func:`predicts` to trust the quadratic.
TOLERANCE = 0.005
#: ... and how close relative to that phase's growth over the last doubling, give or take
#: :data:`SLACK` bytes (allocator rounding).
GROWTH = 0.02
SLACK = 2**20

_FIELDS = ("params", "buffers", "grads", "optimizer", "activations")

Point = tuple[int, MemoryEstimate]


def _quadratic(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The value at ``x`` of the polynomial of degree at most 2 through ``(xs[i], ys[i])`` (Lagrange)."""
    total = 0.0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = float(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= (x - xj) / (xi - xj)
        total += term
    return total


def _phases(e: MemoryEstimate) -> dict[str, int]:
    return dict(e.phase_peaks) if e.phase_peaks else {e.peak_phase: e.peak}


def predict(points: Sequence[Point], tokens: int) -> MemoryEstimate:
    """The estimate at ``tokens`` from three traced ``(tokens, estimate)`` points (distinct lengths):
    each byte count and each phase's peak on the quadratic through them, the step's peak the
    largest phase's, the module holding it the longest point's when the phase is the same; the
    chunk workspace is the largest seen (it does not grow once the chunks have their size)."""
    if len(points) != 3 or len({t for t, _ in points}) != 3:
        raise ValueError(f"predict needs three points at distinct lengths, got {[t for t, _ in points]}")
    points = sorted(points, key=lambda p: p[0])
    xs = [float(t) for t, _ in points]
    values = {f: max(0, int(round(_quadratic(xs, [getattr(e, f) for _, e in points], tokens)))) for f in _FIELDS}
    phase_maps = [_phases(e) for _, e in points]
    names = [p for p in phase_maps[-1] if all(p in m for m in phase_maps)]
    phases = tuple((p, max(0, int(round(_quadratic(xs, [m[p] for m in phase_maps], tokens))))) for p in names)
    last = points[-1][1]
    if not phases:
        phases = ((last.peak_phase, int(round(_quadratic(xs, [e.peak for _, e in points], tokens)))),)
    phase, peak = max(phases, key=lambda item: item[1])
    return dataclasses.replace(
        last, **values, peak=peak, peak_phase=phase, phase_peaks=phases if last.phase_peaks else (),
        peak_module=last.peak_module if phase == last.peak_phase else "",
        workspace=max(e.workspace for _, e in points),
        note=f"extrapolated in length to {tokens:,} tokens from {', '.join(f'{t:,}' for t, _ in points)}")


def predicts(points: Sequence[Point], tolerance: float = TOLERANCE, growth: float = GROWTH) -> bool:
    """Whether the quadratic through the first three of four ``points`` (by length) predicts the
    fourth: every phase's peak within ``tolerance`` of the traced step peak and within ``growth``
    of how much that phase grew from the third point to the fourth (plus :data:`SLACK`). The
    second condition keeps a flat start (a step whose peak is still all parameters and optimizer
    state) from passing: there the growth, the part that decides where the budget is reached, is
    not yet resolved."""
    if len(points) != 4:
        raise ValueError(f"predicts needs four points, got {len(points)}")
    points = sorted(points, key=lambda p: p[0])
    tokens, traced = points[-1]
    guess = predict(points[:3], tokens)
    have, want, before = _phases(guess), _phases(traced), _phases(points[-2][1])
    if have.keys() != want.keys() or not want.keys() <= before.keys():
        return False
    return all(abs(have[p] - want[p]) <= min(tolerance * traced.peak, growth * abs(want[p] - before[p]) + SLACK)
               for p in want)
