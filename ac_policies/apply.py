"""``apply_policy(model, policy)``: carry out a plan by swapping instance ``forward`` methods.

Each wrapped module gets an *instance* attribute ``forward`` that runs the original bound
forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)`` (with torch's selective-checkpoint ``context_fn`` for
``selective``), or, for ``tile``, over slices of its tokens, each slice such a region
(:mod:`ac_policies.tile`), or, for ``offload``, as is under saved-tensor hooks that copy its activations to
pinned host memory on a side CUDA stream during forward and bring them back ahead of their use
in backward (:mod:`ac_policies.offload`). On a module whose parameters are not on a CUDA device
there is nowhere to offload to: ``offload`` runs it as is, keeping activations where they are (as
``none`` would), with one :class:`~ac_policies.plan.ACPolicyWarning` per process. Nothing else
changes: the module's
type, its children, ``named_parameters``/``named_modules``/``state_dict`` keys and
``isinstance`` dispatch stay as they were, and module hooks (FSDP2's included) stay outside
the checkpoint region, so they run once per step. Undo deletes the attribute.

As in Hugging Face, a region is entered only when the module is in training mode and gradients
are enabled; otherwise the original forward runs as is (eval with a KV cache decodes normally).
Keyword arguments reach the module untouched whatever their names (they are bound before
``checkpoint`` sees them). A tiled module recomputes only itself, so it composes with any
checkpointing around it (the policy's, Hugging Face's, ``checkpoint_wrapper``). Hugging Face's own
gradient checkpointing on a module in, around or
under a wrapped one is refused with one message, whether it was enabled before
``apply_policy`` or after (then at the next training forward), and so is torch's
``checkpoint_wrapper`` (Accelerate's FSDP activation checkpointing) anywhere in the model when
the policy is applied, or around, on or under a wrapped module later. Caches: see :mod:`ac_policies.kv_cache`.

Under ``torch.compile`` a region whose modules carry a known net-zero context wrapper (the
``kernels`` package's ``use_kernelized_func``) is traced without dynamo's side-effect check, so
it stays in one graph (see :mod:`ac_policies.compile_compat`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading
import types
import warnings
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from patch_layer import ForwardPatch, Handle, forward_below, swap_forward

from .compile_compat import call_region, side_effect_allowance
from .double_checkpointing import (
    double_checkpointing_error,
    find_checkpoint_wrapper,
    find_hf_flagged,
    lineage,
    trainer_checkpointing_argument,
    with_hf_flag,
    wrapper_checkpointing_error,
)
from .kv_cache import cache_safe, has_cache
from .offload import default_offloader, is_modelling_offload, modelled_offload
from .plan import ACPolicyWarning, Plan, PlanRow, plan
from .seam import policy_companions
from .selective import SelectiveOps, selective_context_fn
from .table import PolicyLike
from .tile import tiled_call

__all__ = ["apply_policy", "PolicyForward", "PolicyHandle", "applied_row", "policy_of", "trainer_checkpointing_argument"]

logger = logging.getLogger(__name__)


def applied_row(module: nn.Module) -> Optional[PlanRow]:
    """The plan row a module is currently wrapped for, or None."""
    fwd = module.__dict__.get("forward")
    return fwd.row if isinstance(fwd, PolicyForward) else None


class PolicyHandle(Handle):
    """Undoes exactly what :func:`apply_policy` did; also a context manager.

    ``plan`` is the :class:`~ac_policies.plan.Plan` that was applied; ``active`` is False after
    :meth:`remove`, through this handle or another one for the same wrappers (from
    :func:`policy_of`). Removing twice is a no-op. If a wrapped module's ``forward`` was replaced
    after the policy wrapped it, the behaviour of every handle of this distribution applies
    (:class:`patch_layer.Handle`): the wrapper is taken out from under that code when the code holds
    it where it can be found (it then calls the module's own forward), else ``remove()`` raises
    ``ValueError`` and changes nothing.
    """

    def __init__(self, plan: Plan, wrappers: list["PolicyForward"], companions: Sequence[Handle] = ()) -> None:
        # companions: handles removed with the policy (Trainer's resume conversion)
        super().__init__(companions, forwards=[ForwardPatch.of(w.module, w) for w in wrappers])
        self.plan = plan
        self._wrappers = wrappers

    @property
    def active(self) -> bool:
        """True until :meth:`remove` succeeds (here or through another handle of the same wrappers)."""
        return not self._removed and any(not w.removed for w in self._wrappers)

    def _undo(self) -> None:
        logger.info("ac_policies: removed %d wrapper(s)", len(self._wrappers))

    def _describe(self) -> str:
        return f"{self.plan.policy.name or 'custom'}: {len(self._wrappers)} module(s)"


def policy_of(obj: Any) -> Optional[PolicyHandle]:
    """The handle of the policy applied to ``obj`` (a model, or anything whose attributes hold one,
    such as a trainer), or None when no module of it is wrapped.

    Works on copies too: a deep copy or an unpickled copy of a model under a policy carries its own
    wrappers, bound to its own modules, and this returns the handle that removes them (the
    original's stay). The handle is built anew on each call from the wrappers found.
    """
    modules = list(obj.modules()) if isinstance(obj, nn.Module) else [
        m for value in vars(obj).values() if isinstance(value, nn.Module) for m in value.modules()
    ]
    wrappers = [m.__dict__["forward"] for m in modules if isinstance(m.__dict__.get("forward"), PolicyForward)]
    if not wrappers:
        return None
    return PolicyHandle(wrappers[0].plan, wrappers)


_offload_warned = False
_offload_warn_lock = threading.Lock()


def _module_device(module: nn.Module, args: tuple, kwargs: dict) -> Optional[torch.device]:
    """The device of the module's first parameter or buffer, else of its first tensor argument."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return None


@torch.compiler.disable
def _warn_offload_in_place(fqn: str, device: Optional[torch.device]) -> None:
    """Warn once per process that ``offload`` keeps activations where they are off CUDA (outside
    compiled graphs: it reads and sets process state)."""
    global _offload_warned
    with _offload_warn_lock:
        if _offload_warned:
            return
        _offload_warned = True
    warnings.warn(
        f"ac_policies: 'offload' on {fqn or '<root>'} runs on {device or 'no device'}, not on a CUDA device: there is "
        "nowhere to offload activations to, so they are kept as they are (the rule behaves as 'none' there). "
        "This warning is shown once per process.",
        ACPolicyWarning,
        stacklevel=2,
    )


@torch.compiler.disable
def _offloaded(module: nn.Module, orig: Callable, args: tuple, kwargs: dict) -> Any:
    """``orig(*args, **kwargs)`` under a new CUDA offload region (eager: the hooks keep Python state)."""
    with default_offloader("cuda").region(module).hooks():
        return orig(*args, **kwargs)


def _run_offloaded(module: nn.Module, row: PlanRow, orig: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``orig`` offloading its saved activations when the module is on CUDA, else as is (one
    warning, unless the rule says ``off_cuda="ignore"``); in an estimate that models a CUDA device,
    under the modelled region."""
    if is_modelling_offload():
        with modelled_offload(module):
            return orig(*args, **kwargs)
    device = _module_device(module, args, kwargs)
    if device is None or device.type != "cuda":
        if not _offload_warned and row.rule.off_cuda == "warn":
            _warn_offload_in_place(row.fqn, device)
        return orig(*args, **kwargs)
    return _offloaded(module, orig, args, kwargs)


class PolicyForward:
    """The instance ``forward`` that :func:`apply_policy` installs on a module: the module's own
    forward (or the instance forward that was there, ``previous``) inside the row's region.

    It is an object, not a closure, so that it belongs to its module: ``copy.deepcopy`` of a model
    (how TRL builds reference models, and EMA or teacher copies) gives each copied module a wrapper
    of its own that runs the copy's weights, and pickling (``torch.save(model)``) stores and
    restores it with the module. The modules around it (for the double-checkpointing checks) are
    those of the copy where the copy holds them, and the ones under it are copied with it. A
    ``previous`` forward that is a closure cannot be copied (it would keep calling the original's
    code): copying refuses it with the reason.

    Attributes:
        module: the wrapped module; ``row``: its plan row; ``plan``: the whole plan;
        ``previous``: the instance forward it replaced, or None (the class's forward);
        ``removed``: whether a handle took it off.
    """

    def __init__(self, module: nn.Module, row: PlanRow, plan: Plan, previous: Any,
                 around: list[tuple[str, nn.Module]], under: list[tuple[str, nn.Module]],
                 allow: Optional[Callable[..., Any]]) -> None:
        self.module, self.row, self.plan, self.previous = module, row, plan, previous
        self.around, self.under, self.allow = around, under, allow
        self.removed = False  # set by the handle that takes it off
        # torch.compile traces checkpoint's context_fn only when one is given, so pass none for plain checkpoint
        self._extra: dict[str, Any] = {}
        if row.action == "selective":
            self._extra["context_fn"] = selective_context_fn(row.selective or SelectiveOps())
        self._lineage = [module, *(m for _, m in around), *(m for _, m in under)]
        # the modules carrying Hugging Face's checkpointing flag, found at the first training forward
        # (a copy's modules are still being filled in while its wrapper is made) and kept: the check
        # runs at every training forward
        self._related: Optional[list[tuple[str, nn.Module]]] = None

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._below()

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._below())

    def _below(self) -> Callable[..., Any]:
        """What this wrapper calls: ``previous``, else the class's forward bound to the module."""
        return forward_below(self.module, self.previous)

    def _call_below(self, /, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _region(self, /, *args: Any, **kwargs: Any) -> Any:
        return call_region(self.allow, self._call_below, *args, **kwargs)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        module, row = self.module, self.row
        # as Hugging Face does: no region in eval mode (cached decoding) or without gradients (no backward)
        if not (module.training and torch.is_grad_enabled()):
            return self._call_below(*args, **kwargs)
        if row.action == "tile":  # recomputes only itself: composes with any checkpointing around it
            return tiled_call(row.fqn, row.rule.tiles, self._region, args, kwargs)
        if self._related is None:
            self._related = with_hf_flag([(row.fqn, module), *self.around, *self.under])
        flagged = find_hf_flagged(self._related)
        if flagged is not None:
            raise double_checkpointing_error(*flagged)
        wrapper = find_checkpoint_wrapper(self._lineage)
        if wrapper is not None:
            raise wrapper_checkpointing_error(wrapper)
        if row.action == "offload":
            return _run_offloaded(module, row, self._call_below, args, kwargs)
        fn = cache_safe(module, row.fqn, self._region, args, kwargs) if has_cache(args, kwargs) else self._region
        # keyword arguments go to the module through a partial, never to checkpoint itself: names such as
        # `debug`, `early_stop`, `function` or `context_fn` would otherwise be taken as checkpoint options
        return checkpoint(functools.partial(fn, **kwargs), *args, use_reentrant=False, preserve_rng_state=True,
                          **self._extra)

    def __deepcopy__(self, memo: dict[int, Any]) -> "PolicyForward":
        module = memo.get(id(self.module))
        if module is None:
            raise TypeError(
                f"copy.deepcopy of the policy wrapper of {self.row.fqn or '<root>'!r} alone: it belongs to its "
                "module; deep-copy the module (or the model) instead"
            )
        previous = copy.deepcopy(self.previous, memo)
        _refuse_closure(previous, self.row.fqn, "copied")
        # the modules around it are the copy's where the copy holds them (a copy of this subtree has no parents)
        around = [(fqn, memo[id(m)]) for fqn, m in self.around if id(m) in memo]
        new = PolicyForward(module, self.row, self.plan, previous, around, copy.deepcopy(self.under, memo), self.allow)
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        _refuse_closure(self.previous, self.row.fqn, "pickled")
        return {k: getattr(self, k) for k in ("module", "row", "plan", "previous", "around", "under", "allow")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"<PolicyForward {self.row.action} {self.row.fqn or '<root>'}>"


def _refuse_closure(previous: Any, fqn: str, how: str) -> None:
    """Refuse to copy a wrapper whose ``previous`` forward is a closure: a copy would call the original's code."""
    if isinstance(previous, types.FunctionType) and previous.__closure__:
        raise TypeError(
            f"the module {fqn or '<root>'!r} cannot be {how} with its activation-checkpointing policy: the forward "
            f"under the policy wrapper ({previous.__qualname__}) is a closure, which a copy would share with the "
            "original and so run the original's module. Remove the policy (ac_policies.policy_of(model).remove()) "
            "or the code that installed that forward before copying, then apply it to the copy"
        )


def apply_policy(model: nn.Module, policy: PolicyLike, *, strict: bool = False) -> PolicyHandle:
    """Apply ``plan(model, policy, strict=strict)`` and return a handle that undoes it.

    Where Transformers is in use, the handle also holds ``model_patches``' Trainer resume
    conversion, as every patch of this library does (a resumed MoE run restores its experts).

    Refuses (ValueError, nothing changed) when the model already carries a policy, has
    Hugging Face gradient checkpointing enabled, or has a module wrapped by torch's
    ``checkpoint_wrapper`` (Accelerate's FSDP activation checkpointing): each would checkpoint
    modules twice.
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
    wrapper = find_checkpoint_wrapper(list(model.modules())) if any(r.action != "tile" for r in p.wrapped) else None
    if wrapper is not None:
        raise wrapper_checkpointing_error(wrapper)
    lineages = {row.fqn: lineage(model, row.fqn) for row in p.wrapped}
    for row in p.wrapped:
        if row.action == "tile":
            continue
        flagged = find_hf_flagged(with_hf_flag(lineages[row.fqn]), training=False)
        if flagged is not None:
            raise double_checkpointing_error(*flagged)
    wrappers: list[PolicyForward] = []
    for row in p.wrapped:
        module = model.get_submodule(row.fqn)
        depth = len(row.fqn.split(".")) + 1 if row.fqn else 1  # the module itself and its ancestors come first
        around, under = lineages[row.fqn][1:depth], lineages[row.fqn][depth:]
        ours = PolicyForward(module, row, p, module.__dict__.get("forward"), around, under,
                             side_effect_allowance(module, row.fqn))
        swap_forward(module, ours)
        wrappers.append(ours)
        logger.info("ac_policies: %s (%s) -> %s  [rule %d: %s]", row.fqn or "<root>", row.module_type, row.action, row.rule_index, row.rule)
    logger.info("ac_policies: applied %s to %s: %d module(s) wrapped", p.policy.name or "custom table", p.model_type, len(wrappers))
    return PolicyHandle(p, wrappers, policy_companions())
