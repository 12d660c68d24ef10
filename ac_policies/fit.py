"""``fit(model, step, budget)``: the table that fits a training step into a memory budget with the
least recompute, measured, as an ordinary :class:`~ac_policies.table.Policy`.

How it chooses (a knapsack over decoder blocks and their submodules):

1. **Measure once without checkpointing**: the step peak (``measure.step_bytes(...).peak``,
   forward plus backward). A budget given as a fraction is a fraction of this peak.
2. **Measure each choice on one block**: blocks of the same structure (class, children, parameter
   shapes) share their measurements; for one block of each kind, every choice is applied alone
   and measured in one step (``measure.step_cost``): the peak it saves and what backward
   recomputes, FLOPs first, then op calls (pointwise ops have no FLOPs, and a ``selective``
   region recomputes only those). The choices are the block itself under each of ``actions``, and
   its large children (attention, MLP or MoE block, mixers: 5% of the block's parameters or more)
   one at a time and in pairs, under each of ``actions``. Choices that save nothing, or save no
   more than a cheaper one, are dropped.
3. **Solve**: savings add up over blocks (each block's activations are kept independently until
   backward reaches it); a dynamic programme over the blocks and their savings (in 1/256ths of
   the peak) gives, for every total saving, the cheapest assignment of one choice per block. The
   assignments that no cheaper one out-saves form a frontier, cheapest first. Tables that give
   each block a single action (the same programme with block-level choices only) join it, so the
   result never recomputes more than the best of those that meets the budget.
4. **Verify**: frontier entries whose predicted peak is within the budget (with a margin for the
   recompute's own transient, which the sum does not see) are applied and measured, cheapest
   first; the first whose measured peak is within the budget is returned. The candidates grow with
   the budget and are tried in cost order, so the recompute never grows with the budget.

The model is left as it was found: no policy, no hooks, its ``.grad`` tensors and RNG state as
before (every measurement runs the step from the same RNG state, and gradients are restored).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import re
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from .apply import applied_row, apply_policy
from .fake import fake_model
from .fit_search import Choice, Option, candidates, select, useful
from .measure import StepCost, step_cost
from .plan import ACPolicyWarning, plan
from .rules import ACTIONS, Rule
from .table import Policy

__all__ = ["fit", "parse_budget", "FitEstimate"]

logger = logging.getLogger(__name__)

Budget = Union[int, float, str]
#: Fraction of a block's parameters from which a child is a choice of its own.
_LARGE_CHILD = 0.05

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BUDGET_TEXT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


@dataclasses.dataclass(frozen=True)
class FitEstimate:
    """What a fitted rule was measured to do: activation bytes it saves at the step peak, and the
    FLOPs and op calls backward spends recomputing it, measured on one block of its kind; ``joint`` > 1 when
    the rule was measured together with the next ``joint - 1`` rules (one choice for a block)."""

    saved_bytes: int
    recompute_flops: int
    recompute_ops: int = 0
    joint: int = 1

    def __str__(self) -> str:
        text = (f"saves {self.saved_bytes / 2**20:.2f} MiB, recomputes {self.recompute_flops / 1e6:.1f} MFLOP "
                f"in {self.recompute_ops} op calls")
        return text + (f" (with the next {self.joint - 1} rule(s))" if self.joint > 1 else "")


def parse_budget(budget: Budget, unconstrained_peak: int) -> int:
    """A budget in bytes: an int (bytes), a string with a unit (``"512MiB"``, ``"8GB"``), or a
    float in (0, 1] (that fraction of ``unconstrained_peak``). Raises ``ValueError`` otherwise."""
    if isinstance(budget, bool):
        raise ValueError(f"budget must be bytes, a size such as '8GB', or a fraction in (0, 1], got {budget!r}")
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(
                f"a fractional budget must be in (0, 1] (a share of the peak without checkpointing), got {budget!r}; "
                "give bytes as an int or a string such as '8GB'"
            )
        return int(budget * unconstrained_peak)
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"budget must be a positive number of bytes, got {budget}")
        return budget
    if isinstance(budget, str):
        found = _BUDGET_TEXT.match(budget)
        unit = found.group(2).lower() if found else ""
        if found is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read budget {budget!r}; write a number and a unit such as '512MiB', '8GB' or '1.5GiB'"
            )
        value = float(found.group(1)) * _UNITS[unit]
        if value < 1:
            raise ValueError(f"budget must be a positive size, got {budget!r}")
        return int(value)
    raise ValueError(f"budget must be bytes, a size such as '8GB', or a fraction in (0, 1], got {type(budget).__name__}")


class _Session:
    """Measurements of one model and step, each from the same RNG state, with the model's
    gradients put aside (and given back by :meth:`close`)."""

    def __init__(self, model: nn.Module, step: Callable[[], torch.Tensor], rng: bool = True) -> None:
        self.model, self.step = model, step
        self.grads = {p: p.grad for p in model.parameters()}
        # fake tensors hold no values: their steps need no RNG state
        self.cpu_rng = torch.get_rng_state() if rng else None
        self.cuda_rng = torch.cuda.get_rng_state_all() if rng and torch.cuda.is_available() else None
        self.costs: dict[tuple[Rule, ...], StepCost] = {}

    def _reset(self) -> None:
        for p in self.grads:
            p.grad = None
        if self.cpu_rng is not None:
            torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def _under(self, rules: Sequence[Rule], run: Callable[[], Any]) -> Any:
        self._reset()
        handle = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ACPolicyWarning)  # MoE recompute notes: the caller's plan says them
            if rules:
                handle = apply_policy(self.model, Policy(tuple(rules)))
        try:
            return run()
        finally:
            if handle is not None:
                handle.remove()

    def cost(self, rules: Sequence[Rule]) -> StepCost:
        """The measured step (peak, recompute) under a table of ``rules`` (cached)."""
        key = tuple(rules)
        if key not in self.costs:
            self.costs[key] = self._under(rules, lambda: step_cost(self.model, self.step))
        return self.costs[key]

    def peak(self, rules: Sequence[Rule]) -> int:
        return self.cost(rules).peak

    def close(self) -> None:
        """Give the model its gradients and the RNG state back."""
        self._reset()
        for p, g in self.grads.items():
            p.grad = g


def _check_actions(actions: Iterable[str]) -> tuple[str, ...]:
    if isinstance(actions, str):
        actions = (actions,)
    out = []
    for a in actions:
        name = a.strip().lower() if isinstance(a, str) else a
        if name not in ACTIONS:
            raise ValueError(f"unknown action {a!r} for fit(); choose among {list(ACTIONS)}")
        if name not in out:
            out.append(name)
    wrapping = [a for a in out if a != "none"]
    if not wrapping:
        raise ValueError(f"fit() needs at least one action that saves memory among {list(ACTIONS)}, got {list(out)}")
    return tuple(wrapping)


def _blocks(model: nn.Module) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ACPolicyWarning)
        rows = plan(model, Policy((Rule(when="decoder_block", action="checkpoint", on_unmatched="ignore"),)))
    return [r.fqn for r in rows]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _kind(block: nn.Module) -> tuple:
    """Blocks of one kind share measurements: class, children and parameter shapes."""
    return (type(block).__qualname__,
            tuple((n, type(c).__qualname__) for n, c in block.named_children()),
            tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))


def _choices(block: nn.Module, actions: tuple[str, ...]) -> list[Choice]:
    total = max(_numel(block), 1)
    large = [n for n, c in block.named_children() if _numel(c) >= _LARGE_CHILD * total]
    groups = [(n,) for n in large] + list(itertools.combinations(large, 2))
    choices = [Choice((("", a),)) for a in actions]
    choices += [Choice(tuple((n, a) for n in group)) for a in actions for group in groups]
    return choices


def fit(
    model: nn.Module,
    step: Callable[..., torch.Tensor],
    budget: Budget,
    *,
    actions: Iterable[str] = ("none", "selective", "checkpoint"),
    fake: Optional[bool] = None,
) -> Policy:
    """The policy with the least recompute whose measured step peak is within ``budget``.

    Args:
        model: a model in training mode without a policy applied (decoder blocks found by
            structure, as the presets find them).
        step: what ``measure.step_bytes`` takes: a zero-argument callable that runs the forward
            (with ``fake``, a one-argument callable taking the model)
            and returns the loss (a scalar tensor); ``fit`` runs the backward.
        budget: the step peak of activation bytes to fit in (``measure.step_bytes(...).peak``):
            bytes (int), a size (``"512MiB"``, ``"8GB"``) or a fraction in (0, 1] of the peak
            without checkpointing.
        actions: what a block or submodule may get (``"none"`` is always allowed).
        fake: measure every step on fake tensors (:func:`ac_policies.fake.fake_model`): the model
            at full size, built on the meta device or with real weights left untouched, and no
            real kernel. ``step`` then takes the model (``step(model) -> loss``, as
            :func:`ac_policies.estimate` takes it) and builds its inputs inside, where they become
            fake. The measurements are the same (live op outputs, by storage), so the table is
            the one a real search gives. Default: True when a parameter is on the meta device.

    Returns:
        A :class:`Policy` named ``fit(...)``: one rule per checkpointed module (exact names), each
        with its :class:`FitEstimate` (``Policy.estimates``; ``print(plan(model, policy))`` shows
        them), and ``Policy.summary`` with the measured and predicted peaks. At a budget the
        model already meets, an empty table (nothing recomputed).

    Raises:
        ValueError: a budget that is not a positive size or a fraction in (0, 1]; an unknown
            action; a model in eval mode, with a policy applied, or without decoder blocks; a
            budget below the smallest peak the choices reach (the message names that peak).
    """
    wrapping = _check_actions(actions)
    if not model.training:
        raise ValueError("fit() measures training steps: put the model in training mode (model.train()) first")
    if any(applied_row(m) is not None for m in model.modules()):
        raise ValueError("fit() needs a model without a policy applied: call handle.remove() on it first")
    blocks = _blocks(model)
    if not blocks:
        raise ValueError(f"fit() found no decoder blocks in {type(model).__name__} to checkpoint")
    on_meta = any(p.device.type == "meta" for p in model.parameters())
    if on_meta and fake is False:
        raise ValueError("a model on the meta device has no values to run: pass fake=True (step then takes the model)")
    if not (on_meta if fake is None else fake):
        session = _Session(model, step)
        try:
            return _fit(session, blocks, budget, wrapping)
        finally:
            session.close()
    with fake_model(model):
        session = _Session(model, lambda: step(model), rng=False)
        try:
            return _fit(session, blocks, budget, wrapping)
        finally:
            session.close()


def _fit(session: _Session, blocks: list[str], budget: Budget, actions: tuple[str, ...]) -> Policy:
    model = session.model
    peak0 = session.peak([])
    limit = parse_budget(budget, peak0)
    name = f"fit({budget!r})"
    if peak0 <= limit:
        return Policy((), name=name, summary=f"measured peak {_mib(peak0)} without checkpointing, within {_mib(limit)}")
    measured: dict[tuple, list[Option]] = {}
    per_block = []
    for fqn in blocks:
        block = model.get_submodule(fqn)
        kind = _kind(block)
        if kind not in measured:
            options = []
            for choice in _choices(block, actions):
                measured_cost = session.cost(choice.rules(fqn))
                options.append(Option(choice, peak0 - measured_cost.peak,
                                       (measured_cost.recompute_flops, measured_cost.recompute_ops)))
            measured[kind] = useful(options)
            logger.info("fit: %s (%d choices measured, %d useful)", fqn, len(options), len(measured[kind]))
        per_block.append(measured[kind])
    ranked = candidates(blocks, per_block, peak0)
    chosen, verified = select(ranked, peak0, limit, lambda c: session.peak(list(c.rules)))
    if chosen is None:
        lowest = session.peak(list(ranked[-1].rules))
        raise ValueError(
            f"budget {_mib(limit)} is below the smallest step peak the choices reach: {_mib(lowest)} "
            f"(measured; {_mib(peak0)} without checkpointing, actions {list(actions)}). "
            f"Fix: a budget of at least {lowest} bytes, or more actions"
        )
    (flops, ops), saved = chosen.cost, chosen.saved
    estimates = tuple(
        FitEstimate(o.saved, o.cost[0], o.cost[1], joint=len(o.choice.parts)) if i == 0 else None
        for o in chosen.picks if o is not None for i in range(len(o.choice.parts))
    )
    peak = session.peak(list(chosen.rules))
    summary = (f"measured peak {_mib(peak)} within {_mib(limit)} ({peak / peak0:.2f}x the {_mib(peak0)} without "
               f"checkpointing; predicted {_mib(peak0 - saved)}), recomputing {flops / 1e6:.1f} MFLOP in {ops} op calls "
               f"({verified} table(s) verified)")
    logger.info("fit: %s", summary)
    return Policy(chosen.rules, name=name, estimates=estimates, summary=summary)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
