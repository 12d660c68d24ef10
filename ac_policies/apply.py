"""``apply_policy(model, policy)``: carry out a plan by swapping instance ``forward`` methods.

Each wrapped module gets an *instance* attribute ``forward`` that runs the original bound
forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)`` (with torch's selective-checkpoint ``context_fn`` for
``selective``), or under ``save_on_cpu`` for ``offload``. Nothing else changes: the module's
type, its children, ``named_parameters``/``named_modules``/``state_dict`` keys and
``isinstance`` dispatch stay as they were, and module hooks (FSDP2's included) stay outside
the checkpoint region, so they run once per step. Undo deletes the attribute.

Under ``torch.compile`` a region whose modules carry a known net-zero context wrapper (the
``kernels`` package's ``use_kernelized_func``) is traced without dynamo's side-effect check, so
it stays in one graph (see :mod:`ac_policies.compile_compat`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .compile_compat import compile_safe
from .plan import Plan, PlanRow, plan
from .selective import DEFAULT_SAVE_OPS, selective_context_fn
from .table import PolicyLike

__all__ = ["apply_policy", "PolicyHandle", "applied_row"]

logger = logging.getLogger(__name__)

_MARK = "_ac_policies_row"
_MISSING = object()


def applied_row(module: nn.Module) -> Optional[PlanRow]:
    """The plan row a module is currently wrapped for, or None."""
    fwd = module.__dict__.get("forward")
    return getattr(fwd, _MARK, None)


class PolicyHandle:
    """Undoes exactly what :func:`apply_policy` did; also a context manager.

    ``plan`` is the :class:`~ac_policies.plan.Plan` that was applied; ``active`` is False
    after :meth:`remove`. Removing twice is a no-op.
    """

    def __init__(self, plan: Plan, changes: list[tuple[nn.Module, PlanRow, Any, Callable]]) -> None:
        self.plan = plan
        self._changes = changes
        self.active = True

    def remove(self) -> None:
        if not self.active:
            return
        for module, row, previous, ours in self._changes:
            if module.__dict__.get("forward") is not ours:
                raise ValueError(
                    f"cannot undo the policy on {row.fqn!r}: its forward was replaced after apply_policy; "
                    "remove the later patch first, then call handle.remove()"
                )
        for module, row, previous, ours in reversed(self._changes):
            if previous is _MISSING:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = previous
        self.active = False
        logger.info("ac_policies: removed %d wrapper(s)", len(self._changes))

    def __enter__(self) -> "PolicyHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<PolicyHandle {self.plan.policy.name or 'custom'}: {len(self._changes)} module(s), {state}>"


def _is_cache(obj: Any) -> bool:
    """A key/value (or recurrent-state) cache, by duck typing (no transformers import)."""
    return callable(getattr(obj, "update", None)) and callable(getattr(obj, "get_seq_length", None)) and not isinstance(
        obj, (dict, torch.Tensor)
    )


def _layer_idx(module: nn.Module) -> Optional[int]:
    for m in module.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int):
            return idx
    return None


def _cached_tokens(cache: Any, idx: Optional[int]) -> Optional[int]:
    """Tokens the cache already holds for layer ``idx`` (0 when empty); None when it cannot tell."""
    if idx is None:
        return None
    layers = getattr(cache, "layers", None)
    if isinstance(layers, (list, tuple)) and idx < len(layers):
        if getattr(layers[idx], "is_initialized", None) is False:
            return 0
    try:
        n = cache.get_seq_length(idx)
    except Exception:  # noqa: BLE001 - foreign cache types; treated as "cannot tell"
        return None
    return int(n) if isinstance(n, int) else None


def _cache_safe(module: nn.Module, fqn: str, orig: Callable, args: tuple, kwargs: dict) -> Callable:
    """A forward for checkpoint that fills an empty cache once and recomputes without it.

    The first call (the real forward) writes this step's keys/values into the cache, as it would
    without checkpointing; the recompute in backward runs with the cache replaced by None, which
    for a layer whose cache was empty computes the same values without a second write. A cache
    that already holds tokens for the layer is refused: the recompute could not reproduce it.
    """
    if torch.compiler.is_compiling():
        raise ValueError(
            f"ac_policies: checkpointed module {fqn!r} received a KV cache under torch.compile; "
            "train with use_cache=False (or cache=None)"
        )
    idx = _layer_idx(module)
    for c in [a for a in args if _is_cache(a)] + [v for v in kwargs.values() if _is_cache(v)]:
        n = _cached_tokens(c, idx)
        if n != 0:
            held = "an unknown number of" if n is None else str(n)
            raise ValueError(
                f"ac_policies: checkpointed module {fqn!r} ({type(module).__name__}) received a "
                f"{type(c).__name__} that already holds {held} token(s) for layer {idx} while gradients are "
                "enabled; recomputing it in backward would not reproduce the cached state and would write the "
                "cache a second time. Train with use_cache=False (or cache=None), or exclude this module with a "
                "rule whose action is 'none'."
            )
    calls = [0]

    def forward_once_with_cache(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] > 1:  # recompute in backward: the cache already holds this step's entries
            a = tuple(None if _is_cache(x) else x for x in a)
            kw = {k: (None if _is_cache(v) else v) for k, v in kw.items()}
        return orig(*a, **kw)

    return forward_once_with_cache


def _make_forward(module: nn.Module, row: PlanRow, orig: Callable) -> Callable:
    action = row.action
    # torch.compile traces checkpoint's context_fn only when one is given, so pass none for plain checkpoint
    extra: dict[str, Any] = {}
    if action == "selective":
        extra["context_fn"] = selective_context_fn(row.rule.ops if row.rule.ops is not None else DEFAULT_SAVE_OPS)
    fqn = row.fqn
    region = compile_safe(module, fqn, orig)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # no backward, nothing to save or recompute
            return orig(*args, **kwargs)
        if action == "offload":
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return orig(*args, **kwargs)
        fn = region
        if any(_is_cache(a) for a in args) or any(_is_cache(v) for v in kwargs.values()):
            fn = _cache_safe(module, fqn, region, args, kwargs)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    functools.update_wrapper(forward, orig, updated=())
    setattr(forward, _MARK, row)
    return forward


def apply_policy(model: nn.Module, policy: PolicyLike, *, strict: bool = False) -> PolicyHandle:
    """Apply ``plan(model, policy, strict=strict)`` and return a handle that undoes it.

    Refuses (ValueError, nothing changed) when the model already carries a policy or has
    Hugging Face gradient checkpointing enabled: either would checkpoint modules twice.
    Apply before ``torch.compile`` and before FSDP2 ``fully_shard``.
    """
    p = plan(model, policy, strict=strict, _stacklevel=3)
    for fqn, m in model.named_modules():
        row = applied_row(m)
        if row is not None:
            raise ValueError(
                f"{type(model).__name__} already has an activation-checkpointing policy applied "
                f"({fqn or '<root>'} -> {row.action}); call handle.remove() on it before applying another"
            )
        if getattr(m, "gradient_checkpointing", False) is True:
            raise ValueError(
                f"Hugging Face gradient checkpointing is enabled on {fqn or '<root>'} ({type(m).__name__}); "
                "call model.activation_checkpointing_disable() (gradient_checkpointing_disable() before Transformers 5.x) "
                "before apply_policy, or the blocks are checkpointed twice"
            )
    changes: list[tuple[nn.Module, PlanRow, Any, Callable]] = []
    for row in p.wrapped:
        module = model.get_submodule(row.fqn)
        previous = module.__dict__.get("forward", _MISSING)
        ours = _make_forward(module, row, module.forward)
        module.__dict__["forward"] = ours
        changes.append((module, row, previous, ours))
        logger.info("ac_policies: %s (%s) -> %s  [rule %d: %s]", row.fqn or "<root>", row.module_type, row.action, row.rule_index, row.rule)
    logger.info("ac_policies: applied %s to %s: %d module(s) wrapped", p.policy.name or "custom table", p.model_type, len(changes))
    return PolicyHandle(p, changes)
