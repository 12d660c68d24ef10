"""``plan(model, policy)``: what a policy would do to a model, as frozen rows, touching nothing."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from typing import Iterable, Optional

from torch import nn

from .predicates import NAMED_PREDICATES
from .presets import resolve_policy
from .rules import Rule
from .selective import DEFAULT_SAVE_OPS, SelectiveOps
from .structure import planning
from .table import Policy, PolicyLike
from .tile import not_position_wise

__all__ = ["PlanRow", "Plan", "plan", "ACPolicyWarning"]

logger = logging.getLogger(__name__)

WRAPPING_ACTIONS = frozenset({"checkpoint", "selective", "offload", "tile"})
RECOMPUTING_ACTIONS = frozenset({"checkpoint", "selective"})


class ACPolicyWarning(UserWarning):
    """A policy that applies but probably not as intended (a rule matched nothing, nesting, MoE recompute)."""


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One module a rule matched: its name, the rule (and its index in the table), the action.

    ``selective``: for a ``selective`` row, the rule's op choices with module globs resolved
    to weight shapes.
    """

    fqn: str
    rule_index: int
    rule: Rule
    action: str
    module_type: str
    selective: Optional[SelectiveOps] = None


def _matmul_shapes(model: nn.Module, globs: tuple[str, ...], unmatched: list[str]) -> frozenset:
    """Shapes of ``weight.t()`` (as ``mm`` sees it) for the 2-D weights of every module matching a glob.

    A matched module's weights include its descendants' (a router whose linear is a child).
    ``globs`` are alternatives: only when none matches is the list reported as unmatched.
    """
    shapes = set()
    for glob in globs:
        hits = [(fqn, m) for fqn, m in model.named_modules() if fnmatch.fnmatchcase(fqn, glob)]
        weights = [w for _, m in hits for n, w in m.named_parameters() if n.rpartition(".")[2] == "weight" and w.dim() == 2]
        if hits and not weights:
            fqn, m = hits[0]
            raise ValueError(
                f"matmul glob {glob!r} matched {fqn!r} ({type(m).__name__}) and holds no 2-D weight; "
                "name modules holding a linear weight (nn.Linear, a MoE router), e.g. '*.mlp.gate'"
            )
        shapes.update((int(w.shape[1]), int(w.shape[0])) for w in weights)
    if globs and not shapes:
        unmatched.append(", ".join(globs))
    return frozenset(shapes)


def _selective_specs(model: nn.Module, table: Policy, unmatched: list[str]) -> dict[int, SelectiveOps]:
    specs = {}
    for i, rule in enumerate(table.rules):
        if rule.action != "selective":
            continue
        specs[i] = SelectiveOps(
            save=rule.ops if rule.ops is not None else DEFAULT_SAVE_OPS,
            every=rule.recompute_every,
            recompute_shapes=_matmul_shapes(model, rule.recompute_matmuls_of or (), unmatched),
            save_shapes=_matmul_shapes(model, rule.save_matmuls_of or (), unmatched),
            copies_to_cpu_from=frozenset(rule.save_copies_to_cpu_from or ()),
        )
    return specs


def _under(child: str, parent: str) -> bool:
    return (parent == "" and child != "") or child.startswith(parent + ".")


class Plan(tuple):
    """The rows of a plan (a tuple of :class:`PlanRow`), plus what looked wrong.

    ``wrapped`` lists the rows whose action changes the module (not ``none``); ``tiled`` the
    ``tile`` rows; ``unmatched``
    the indices of rules that matched no module; ``nested`` the (outer, inner) pairs of
    wrapped modules inside one another; ``moe_recomputed`` the MoE blocks a recomputing region
    covers. ``str(plan)`` is an aligned table.
    """

    policy: Policy
    unmatched: tuple[int, ...]
    nested: tuple[tuple[str, str], ...]
    moe_recomputed: tuple[str, ...]
    model_type: str

    def __new__(cls, rows: Iterable[PlanRow], *, policy: Policy, unmatched=(), nested=(), moe_recomputed=(), model_type=""):
        self = super().__new__(cls, tuple(rows))
        self.policy = policy
        self.unmatched = tuple(unmatched)
        self.nested = tuple(nested)
        self.moe_recomputed = tuple(moe_recomputed)
        self.model_type = model_type
        return self

    def __getnewargs_ex__(self) -> tuple[tuple, dict]:
        # pickling and copying: the keyword-only fields go back through __new__
        return (tuple(self),), dict(policy=self.policy, unmatched=self.unmatched, nested=self.nested,
                                    moe_recomputed=self.moe_recomputed, model_type=self.model_type)

    @property
    def tiled(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self if r.action == "tile")

    @property
    def wrapped(self) -> tuple[PlanRow, ...]:
        return tuple(r for r in self if r.action in WRAPPING_ACTIONS)

    def __str__(self) -> str:
        header: tuple[str, ...] = ("module", "type", "action", "rule")
        cells = [(r.fqn or "<root>", r.module_type, r.action, f"{r.rule_index}: {r.rule}") for r in self]
        if self.policy.estimates:
            header += ("measured (fit)",)
            cells = [c + (self.policy._estimate(r.rule_index).strip(" []"),) for c, r in zip(cells, self)]
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(header)]
        fmt = lambda row: "  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()  # noqa: E731
        name = self.policy.name or "custom table"
        lines = [f"plan of {name} on {self.model_type}: {len(self.wrapped)} module(s) wrapped", fmt(header)]
        if self.policy.summary:
            lines.insert(1, self.policy.summary)
        lines.append(fmt(["-" * w for w in widths]))
        lines += [fmt(c) for c in cells]
        lines += [f"warning: rule {i} ({self.policy.rules[i]}) matched no module" for i in self.unmatched]
        lines += [f"warning: nested regions: {inner!r} inside {outer!r}" for outer, inner in self.nested]
        return "\n".join(lines)


def plan(model: nn.Module, policy: PolicyLike, *, strict: bool = False, _stacklevel: int = 2) -> Plan:
    """Match every module of ``model`` against ``policy`` (first matching rule wins).

    Returns a :class:`Plan` without changing the model. Raises ValueError when a rule with
    ``on_unmatched="error"`` matches nothing (e.g. a MoE-scoped preset on a dense model). Rules that
    match nothing (unless ``on_unmatched="ignore"``) and nested wrapped regions (other than a tiled
    module inside a block with another action, which is how they compose) are warned about (:class:`ACPolicyWarning`), or
    rejected with ValueError when ``strict``. A table that recomputes a MoE block warns once. A
    ``tile`` rule matching a module that is not position-wise (attention, a decoder block, a
    convolution) raises ValueError with the reason.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"plan() takes an nn.Module, got {type(model).__name__}")
    table = resolve_policy(policy)
    rows: list[PlanRow] = []
    hit = [False] * len(table)
    moe_fqns: list[str] = []
    is_moe = NAMED_PREDICATES["moe"]
    unmatched_globs: list[str] = []
    specs = _selective_specs(model, table, unmatched_globs)
    with planning(model):
        for fqn, module in model.named_modules():
            if is_moe(fqn, module):
                moe_fqns.append(fqn)
            found = table.first_match(fqn, module)
            if found is None:
                continue
            i, rule = found
            if rule.action == "tile":
                reason = not_position_wise(fqn, module)
                if reason is not None:
                    raise ValueError(f"rule {i} ({rule}) cannot tile {fqn or '<root>'}: {reason}")
            hit[i] = True
            rows.append(PlanRow(fqn, i, rule, rule.action, type(module).__name__, specs.get(i)))
    unmatched = [i for i, h in enumerate(hit) if not h and table.rules[i].on_unmatched != "ignore"]
    required = [i for i in unmatched if table.rules[i].on_unmatched == "error"]
    model_type = type(model).__name__
    if required:
        name = f"preset {table.name!r}" if table.name else "the table"
        hint = " It needs a MoE block (a router/gate child plus an experts child); use 'full' or 'selective' for a dense model." if any(
            "moe" in str(table.rules[i].when) for i in required) else ""
        raise ValueError(
            f"{name}: required rule(s) {[f'{i}: {table.rules[i]}' for i in required]} matched no module of "
            f"{model_type}.{hint}"
        )
    wrapped = [r for r in rows if r.action in WRAPPING_ACTIONS]
    # a tiled module inside a block with another action, and anything inside an offloaded module
    # (whose region then holds what the inner regions keep), is how they compose; any other
    # nesting runs a region inside another
    nested = [(o.fqn, r.fqn) for o in wrapped for r in wrapped
              if _under(r.fqn, o.fqn) and not (r.action == "tile" and o.action != "tile") and o.action != "offload"]
    recomputing = [r.fqn for r in wrapped if r.action in RECOMPUTING_ACTIONS]
    moe_hit = sorted({m for m in moe_fqns for w in recomputing if m == w or _under(m, w) or _under(w, m)})
    result = Plan(rows, policy=table, unmatched=unmatched, nested=nested, moe_recomputed=moe_hit, model_type=model_type)
    problems = [f"rule {i} ({table.rules[i]}) matched no module of {model_type}" for i in unmatched]
    problems += [f"matmul globs [{g}] matched no module of {model_type}" for g in unmatched_globs]
    problems += [f"nested wrapped regions: {inner!r} inside {outer!r} (the inner one is recomputed twice)" for outer, inner in nested]
    if problems and strict:
        raise ValueError("strict plan rejected: " + "; ".join(problems) + ". Fix the table or pass strict=False.")
    for p in problems:
        warnings.warn(p, ACPolicyWarning, stacklevel=_stacklevel)
    if moe_hit:
        msg = (
            f"{len(moe_hit)} MoE block(s) ({moe_hit[0]}{', ...' if len(moe_hit) > 1 else ''}) lie in a checkpointed "
            "region: their router and experts are rerun in backward (under 'selective', every op the rule's op "
            "list does not save, routing included); the 'non_moe' preset leaves MoE blocks alone"
        )
        warnings.warn(msg, ACPolicyWarning, stacklevel=_stacklevel)
    return result

