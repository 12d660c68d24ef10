"""What the family tests of ``ac_policies`` read off a tiny model (``test_ac_families``,
``test_ac_reach``): one shared model per family, the modules each structural predicate
recognises, and how often chosen leaf modules run in forward and again in backward."""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from typing import Any

import torch

import ac_policies
from tests.support.tiny_models import tiny_ac_model

PRESETS = ["full", "selective", "non_moe", "non_moe_no_attn"]
#: The structural predicates a rule's ``when`` can name.
KINDS = ("moe", "attention", "linear_attention", "dense_mlp", "decoder_block")


@functools.cache
def model_of(family: str) -> torch.nn.Module:
    """The tiny model of ``family``, built once and shared by the tests that read it."""
    return tiny_ac_model(family)


def recognised(model: torch.nn.Module, kind: str) -> list[str]:
    """fqns of the modules the structural predicate ``kind`` recognises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = ac_policies.plan(model, [ac_policies.Rule(when=kind, action="none", on_unmatched="ignore")])
        return [r.fqn for r in plan]


def structure(model: torch.nn.Module) -> dict[str, list[str]]:
    """:func:`recognised` for every predicate of :data:`KINDS`."""
    return {kind: recognised(model, kind) for kind in KINDS}


def first_linear(module: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in module.modules() if isinstance(m, torch.nn.Linear))


def watched_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Leaf modules to count: each mixer's first projection (``mixer:<fqn>``), each MoE block's
    router (``router:<fqn>``) and experts (``experts:<fqn>``)."""
    watched = {}
    for fqn in recognised(model, "attention") + recognised(model, "linear_attention"):
        watched[f"mixer:{fqn}"] = first_linear(model.get_submodule(fqn))
    for fqn in recognised(model, "moe"):
        kids = dict(model.get_submodule(fqn).named_children())
        watched[f"router:{fqn}"] = kids.get("gate", kids.get("router"))
        watched[f"experts:{fqn}"] = kids.get("experts", kids.get("input_linear"))
    return watched


def call_counts(model: torch.nn.Module, inputs: dict[str, Any],
                watched: dict[str, torch.nn.Module]) -> tuple[Counter, Counter]:
    """(forward-phase, backward-phase) call counts of the watched modules over one step of
    ``model(**inputs).loss``."""
    phase = {"bwd": False}
    fwd, bwd = Counter(), Counter()
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: (bwd if phase["bwd"] else fwd).update([name]))
             for name, m in watched.items()]
    try:
        model.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        phase["bwd"] = True
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return fwd, bwd
