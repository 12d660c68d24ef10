"""``longest_context(model, make_step, budget)``: the longest sequence whose training step fits a
per-process memory budget, searched on fake tensors, for the model as it is and for the plan the
library recommends (the ``long_context`` policy, with checkpoint offload on CUDA, and the
hidden-state loss).

The search doubles the length from ``start`` until a step no longer fits or the estimates lie on
a quadratic in tokens (:mod:`ac_policies.estimate.length`); then it traces the length the quadratic
puts at the budget, and, where the prediction holds there, takes the next length it puts over the
budget as "too long". Otherwise it halves the gap until the shortest length too long is at most
``resolution`` times the longest that fits. Each traced length is one :func:`~ac_policies.estimate`
(at full depth, or extrapolated from two shallow copies of the model,
:mod:`ac_policies.estimate.depth`); nothing runs on a device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..apply import apply_policy, policy_of
from ..plan import ACPolicyWarning
from ..seam import apply_loss_patch
from .api import Step, estimate
from .depth import decoder_layout, estimate_at_depth, with_phase_peak
from .length import TOLERANCE, predict, predicts
from .result import MemoryEstimate, format_bytes

__all__ = ["ContextRow", "LongestContext", "longest_context"]

logger = logging.getLogger(__name__)

MakeStep = Callable[[int], Step]


@dataclasses.dataclass(frozen=True)
class ContextRow:
    """One plan's answer: ``tokens`` fit (0: not even ``start``), ``too_long`` does not (0: the
    search reached ``max_tokens``), with the estimates at both and what stops a longer context."""

    plan: str
    tokens: int
    fits: Optional[MemoryEstimate]
    too_long: int
    over: Optional[MemoryEstimate]
    limit: str

    @property
    def too_long_predicted(self) -> bool:
        """Whether ``too_long``'s estimate is predicted from traced lengths rather than traced
        (:mod:`ac_policies.estimate.length`); ``tokens``' always is traced."""
        return self.over is not None and (self.over.note or "").startswith("extrapolated in length")


@dataclasses.dataclass(frozen=True)
class LongestContext:
    """The answer of :func:`longest_context`: one :class:`ContextRow` per plan, and the budget."""

    budget: int
    rows: tuple[ContextRow, ...]
    world_size: int = 1
    offload_params: bool = False
    context_parallel: int = 1

    @property
    def tokens(self) -> int:
        """The longest context of the best plan."""
        return max(r.tokens for r in self.rows)

    def __str__(self) -> str:
        shard = f", FSDP2 over {self.world_size} processes" if self.world_size > 1 else ""
        shard += ", parameters, gradients and optimizer state in host memory" if self.offload_params else ""
        if self.context_parallel > 1:
            shard += f", the sequence sharded over {self.context_parallel} processes"
        header = ("plan", "longest", "peak", "too long", "its peak", "peak in", "what limits it")
        cells = []
        for r in self.rows:
            where = f"{r.over.peak_phase}, {r.over.peak_module or 'the model itself'}" if r.over else ""
            star = "*" if r.too_long_predicted else ""
            cells.append((r.plan, f"{r.tokens:,}", format_bytes(r.fits.peak) if r.fits else "-",
                          f"{r.too_long:,}{star}" if r.too_long else "-",
                          format_bytes(r.over.peak) + star if r.over else "-", where, r.limit))
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
        line = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
        return "\n".join([f"longest context within {format_bytes(self.budget)} per process{shard} "
                          "(estimated on fake tensors)", line(header), line(["-" * w for w in widths]),
                          *(line(c) for c in cells),
                          *(["*: predicted by the quadratic in length through the traced lengths nearest it "
                             "(every answer is traced)"] if any(r.too_long_predicted for r in self.rows) else [])])


def _limit(e: MemoryEstimate, budget: int) -> str:
    """What holds the peak of a step that does not fit, and what would move it."""
    state = e.params + e.buffers + e.grads + e.optimizer
    if state >= budget:
        return (f"parameters, gradients and optimizer state alone take {format_bytes(state)}: shard them (FSDP2 "
                "over more processes) or keep them in host memory")
    if e.peak_phase == "optimizer":
        return (f"the optimizer step: parameters, gradients and optimizer state ({format_bytes(state)}) and the "
                "optimizer's temporaries: shard them (FSDP2 over more processes) or keep them in host memory "
                "(offload_params)")
    transient = e.peak - state - e.activations
    if e.activations >= transient:
        return (f"activations kept after forward ({format_bytes(e.activations)}): checkpoint more, offload "
                "them to host memory, or shard the sequence (context parallelism)")
    inside = e.peak_module or "the model itself"
    return (f"one {e.peak_phase} working set ({format_bytes(transient)} above what is kept, in {inside}): tile "
            "it, or shard the sequence (context parallelism)")


#: At most this many lengths are traced per plan.
MAX_TRACES = 64
#: The furthest the search jumps past the longest length traced (a factor): a crossing predicted
#: further away is approached by doubling, which costs about as much as one trace there.
MAX_JUMP = 8


def _search(run: Callable[[int], MemoryEstimate], budget: int, start: int, max_tokens: int, resolution: float,
            multiple: int) -> tuple[int, Optional[MemoryEstimate], int, Optional[MemoryEstimate]]:
    """``(longest that fits, its estimate, shortest too long, its estimate)``.

    The length doubles from ``start`` until a step does not fit, or until the four traced lengths
    nearest the longest fit lie on a quadratic in tokens
    (:func:`~ac_policies.estimate.length.predicts`) and it puts the budget within
    :data:`MAX_JUMP` times that length. Then the search jumps to the longest length the quadratic
    puts within the budget (with its tolerance to spare) and traces it; when that fits and the
    trace agrees with the prediction, the next length the quadratic puts clearly over the budget
    is the answer's "too long" (a predicted estimate, noted as such). When the prediction is not
    trusted or misses, the gap between the longest fit and the shortest too long is halved with
    traces. A trace costs about its length (a tiled module runs one region per slice), so this
    keeps a million-token search to the doubling up to a quarter of the answer and one trace at it.
    """
    traced: dict[int, MemoryEstimate] = {}

    def trial(tokens: int) -> bool:
        e = run(tokens)
        traced[tokens] = e
        ok = e.peak <= budget
        logger.info("longest_context: %d tokens -> peak %s (%s)", tokens, format_bytes(e.peak), "fits" if ok else "over")
        return ok

    def nearest(tokens: int, count: int = 3) -> list[tuple[int, MemoryEstimate]]:
        """The ``count`` traced lengths nearest ``tokens`` (by ratio), with their estimates."""
        order = sorted(traced, key=lambda t: abs(math.log(t / tokens)))
        return [(t, traced[t]) for t in order[:count]]

    def crossing(lower: int, upper: int) -> int:
        """The longest multiple in ``(lower, upper]`` predicted to fit with the prediction's
        tolerance to spare (``lower`` when none is)."""
        points = nearest(lower)
        room = budget * (1 - TOLERANCE)
        k_lo, k_hi = lower // multiple, upper // multiple
        while k_lo < k_hi:
            k = (k_lo + k_hi + 1) // 2
            if k * multiple > lower and predict(points, k * multiple).peak > room:
                k_hi = k - 1
            else:
                k_lo = k
        return max(lower, k_lo * multiple)

    lo, hi = 0, 0
    t, expected = start, None
    for _ in range(MAX_TRACES):
        ok = trial(t)
        if ok:
            lo = max(lo, t)
        else:
            hi = min(hi or t, t)
        if not lo:
            break
        if ok and t >= max_tokens or hi and hi <= lo * resolution:
            break
        near = nearest(lo, 4)
        if expected is not None and ok and abs(expected.peak - traced[t].peak) <= TOLERANCE * traced[t].peak:
            # the traced answer is where the quadratic put it: the next length it puts over is "too long"
            over = _predicted_over(lambda n, points=nearest(lo): predict(points, n), budget, lo, max_tokens, resolution, multiple)
            if over is not None:
                return lo, traced[lo], over[0], over[1]
        expected = None
        if len(near) == 4 and predicts(near):
            guess = crossing(lo, (hi - multiple) if hi else max_tokens)
            if lo < guess and (hi or guess < MAX_JUMP * lo):
                t, expected = guess, predict(nearest(guess), guess)
                continue
        if not hi:
            t = min(2 * lo, max_tokens)
            continue
        mid = (lo + hi) // 2 // multiple * multiple
        if mid <= lo or mid >= hi:
            break
        t = mid
    return lo, traced.get(lo), hi, traced.get(hi)


def _predicted_over(at: Callable[[int], MemoryEstimate], budget: int, fits: int, max_tokens: int,
                    resolution: float, multiple: int) -> Optional[tuple[int, MemoryEstimate]]:
    """The shortest multiple above ``fits`` (up to ``resolution`` times it) that the prediction
    ``at`` puts over the budget by more than twice its tolerance, with that prediction; None when
    there is none (the search then traces on)."""
    margin = budget * (1 + 2 * TOLERANCE)
    k_lo, k_hi = fits // multiple, min(int(fits * resolution), max_tokens) // multiple
    if k_hi <= k_lo or at(k_hi * multiple).peak <= margin:
        return None
    while k_hi - k_lo > 1:  # the shortest multiple over the margin: the prediction rises with length
        k = (k_lo + k_hi) // 2
        if at(k * multiple).peak > margin:
            k_hi = k
        else:
            k_lo = k
    return k_hi * multiple, at(k_hi * multiple)


def _recommended(model: nn.Module, device: Optional[str]) -> tuple[list[Any], list[str]]:
    """Apply what the recommended plan adds to ``model`` (``long_context``, with checkpoint offload
    on CUDA; the hidden-state loss) where it is not there yet; the
    handles and the names of what was added."""
    handles, added = [], []
    if policy_of(model) is None:
        preset = "long_context"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ACPolicyWarning)
            handles.append(apply_policy(model, preset))
        added.append(preset)
    try:
        handle = apply_loss_patch(model, "linear")
    except (ValueError, RuntimeError) as exc:  # a loss patch is there already
        logger.info("longest_context: the hidden-state loss is not added (%s)", exc)
    else:
        handles.append(handle)
        added.append("hidden-state loss")
    return handles, added


def longest_context(model: nn.Module, make_step: MakeStep, budget: Union[int, str], *, world_size: int = 1,
                    device: Optional[str] = "cuda", optimizer: Any = "adamw", offload_params: bool = False,
                    start: int = 1024,
                    max_tokens: int = 1 << 22, resolution: float = 1.25, recommend: bool = True,
                    full_depth: bool = False, context_parallel: int = 1) -> LongestContext:
    """The longest sequence whose training step of ``model`` fits ``budget`` bytes per process.

    Args:
        model: an ``nn.Module`` in training mode (on the meta device at full size, or real; it is
            left as it was), with whatever policy and loss patch it trains with.
        make_step: ``make_step(tokens) -> step``, ``step(model) -> loss`` as :func:`estimate` takes
            it, building a batch of ``tokens`` tokens.
        budget: bytes per process, or a size such as ``"80GB"``.
        world_size, device, optimizer, offload_params: as :func:`estimate`.
        start, max_tokens: the first length tried and the last.
        resolution: the search stops when the shortest length too long is at most this times the
            longest that fits (lengths are multiples of ``start``'s largest power of two up to 256).
            Where the estimates lie on a quadratic in length, the answer is the length the quadratic
            puts at the budget (traced) and "too long" the next it puts over it (predicted, marked
            ``*`` in the table and by :attr:`ContextRow.too_long_predicted`): usually much finer.
        recommend: also answer for the recommended plan: the model with the ``long_context`` policy
            (for ``device="cuda"`` with the blocks' checkpoints in host memory),
            unless it has a policy already, and the hidden-state loss, unless it has a loss patch.
        context_parallel: processes the sequence is sharded over (``model_patches.enable_context_parallel``,
            as :func:`estimate` models it): lengths are the whole sequence's, and ``make_step`` is
            asked for one process's share (``ceil(tokens / context_parallel)``).
        full_depth: trace every length at full depth; by default a decoder whose blocks repeat is
            traced at two shallow depths and extrapolated (:mod:`ac_policies.estimate.depth`), and
            the optimizer step's peak is taken from one full-depth trace at ``start`` tokens.

    Returns:
        A :class:`LongestContext` that prints as a table: per plan, the longest length that fits
        with its peak, the first that does not, where its peak is and what limits going further.
    """
    from ..fit import parse_budget

    limit = parse_budget(budget, 1)
    if isinstance(budget, float):
        raise ValueError("longest_context takes a budget in bytes or a size such as '80GB', not a fraction")
    if not 1.0 < resolution <= 2.0:
        raise ValueError(f"resolution must be in (1, 2], got {resolution!r}")
    if start < 1 or max_tokens < start:
        raise ValueError(f"need 1 <= start <= max_tokens, got start={start}, max_tokens={max_tokens}")
    layout = None if full_depth else decoder_layout(model)
    multiple = max(1, min(256, start & -start))
    reduced = layout is not None and layout.reducible
    kwargs = dict(optimizer=optimizer, world_size=world_size, device=device, offload_params=offload_params,
                  context_parallel=context_parallel)

    def run(tokens: int, optimizer_peak: Optional[int]) -> MemoryEstimate:
        step = make_step(-(-tokens // context_parallel))
        e = estimate_at_depth(model, lambda: estimate(model, step, **kwargs), layout)
        return e if optimizer_peak is None else with_phase_peak(e, "optimizer", optimizer_peak)

    def optimizer_peak() -> Optional[int]:
        """The optimizer step's peak at full depth (the same at every length), when extrapolating."""
        if not reduced or optimizer is None:
            return None
        return dict(estimate(model, make_step(-(-start // context_parallel)), **kwargs).phase_peaks).get("optimizer")

    def answer(plan: str) -> ContextRow:
        at_full_depth = optimizer_peak()
        tokens, fits, too_long, over = _search(lambda t: run(t, at_full_depth), limit, start, max_tokens,
                                               resolution, multiple)
        why = _limit(over, limit) if over is not None else f"fits up to max_tokens={max_tokens:,}"
        return ContextRow(plan, tokens, fits, too_long, over, why)

    rows = [answer("as is")]
    if recommend:
        handles, added = _recommended(model, device)
        try:
            if added:
                rows.append(answer("+ " + " + ".join(added)))
        finally:
            for h in reversed(handles):
                h.remove()
    return LongestContext(limit, tuple(rows), world_size, offload_params, context_parallel)


def token_step(vocab: int, batch: int = 1) -> MakeStep:
    """``make_step`` for a causal LM: ``batch`` random rows of ``tokens`` ids, the labels the ids."""
    def make(tokens: int) -> Step:
        def step(model: nn.Module) -> torch.Tensor:
            ids = torch.randint(0, vocab, (batch, tokens))
            return model(input_ids=ids, labels=ids).loss
        return step
    return make
