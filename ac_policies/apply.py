"""``apply_policy(model, policy)``: carry out a plan by swapping instance ``forward`` methods.

Each wrapped module gets an *instance* attribute ``forward`` that runs the original bound
forward under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
preserve_rng_state=True)`` (with torch's selective-checkpoint ``context_fn`` for
``selective``), or, for ``offload``, as is under saved-tensor hooks that copy its activations to
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
``checkpoint`` sees them). Hugging Face's own gradient checkpointing on a module in, around or
under a wrapped one is refused with one message, whether it was enabled before
``apply_policy`` or after (then at the next training forward), and so is torch's
``checkpoint_wrapper`` (Accelerate's FSDP activation checkpointing) anywhere in the model when
the policy is applied, or around, on or under a wrapped module later. Caches: see :mod:`ac_policies.cache`.

Under ``torch.compile`` a region whose modules carry a known net-zero context wrapper (the
``kernels`` package's ``use_kernelized_func``) is traced without dynamo's side-effect check, so
it stays in one graph (see :mod:`ac_policies.compile_compat`).
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .cache import cache_safe, has_cache
from .compile_compat import compile_safe
from .offload import default_offloader
from .plan import ACPolicyWarning, Plan, PlanRow, plan
from .selective import SelectiveOps, selective_context_fn
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
    after :meth:`remove`. Removing twice is a no-op. If a wrapped module's ``forward`` was
    replaced after the policy wrapped it, ``remove()`` raises ``ValueError`` and changes
    nothing: putting the previous forward back would delete that later code.
    """

    def __init__(self, plan: Plan, changes: list[tuple[nn.Module, PlanRow, Any, Callable]]) -> None:
        self.plan = plan
        self._changes = changes
        self._removed = False

    @property
    def active(self) -> bool:
        """True until :meth:`remove` succeeds."""
        return not self._removed

    def remove(self) -> None:
        if self._removed:
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
        self._removed = True
        logger.info("ac_policies: removed %d wrapper(s)", len(self._changes))

    def __enter__(self) -> "PolicyHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<PolicyHandle {self.plan.policy.name or 'custom'}: {len(self._changes)} module(s), {state}>"


def _hf_flagged(modules: list[tuple[str, nn.Module]], training: bool = True) -> Optional[tuple[str, nn.Module]]:
    """The first module with Hugging Face gradient checkpointing switched on (and, if ``training``, in training mode)."""
    for fqn, m in modules:
        if getattr(m, "gradient_checkpointing", False) is True and (m.training or not training):
            return fqn, m
    return None


def trainer_checkpointing_argument() -> str:
    """The training argument that keeps ``Trainer.train()`` (and TRL's trainers) from turning
    Hugging Face checkpointing on: ``activation_checkpointing`` where the installed Transformers'
    ``TrainingArguments`` has it (5.25 among the tested releases; not 5.22 or 4.57), else
    ``gradient_checkpointing``."""
    import transformers

    fields = getattr(transformers.TrainingArguments, "__dataclass_fields__", {})
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def double_checkpointing_error(fqn: str, module: nn.Module) -> ValueError:
    """The one message for a policy combined with Hugging Face's own gradient checkpointing."""
    argument = trainer_checkpointing_argument()
    return ValueError(
        f"activation checkpointing twice: Hugging Face gradient checkpointing is enabled on {fqn or '<root>'} "
        f"({type(module).__name__}) and an ac_policies policy wraps modules in or around it, so they would be "
        "recomputed twice. Use one. Under transformers.Trainer or TRL's trainers, train() turns Hugging Face's "
        f"checkpointing on from the training arguments: pass {argument}=False in TrainingArguments / SFTConfig "
        "(TRL's configs default gradient_checkpointing to True; calling model.gradient_checkpointing_disable() "
        f"before train() is undone by train()). Outside a trainer: model.{argument}_disable(). "
        "Or remove the policy with handle.remove()."
    )


def _checkpoint_wrapped(modules: list[nn.Module]) -> Optional[nn.Module]:
    """The first of ``modules`` or of their children that is torch's ``checkpoint_wrapper`` (it keeps
    the module it wraps as ``_checkpoint_wrapped_module``; Accelerate's FSDP activation
    checkpointing and ``apply_activation_checkpointing`` wrap modules with it)."""
    for m in modules:
        if hasattr(m, "_checkpoint_wrapped_module"):
            return m
        for child in m._modules.values():
            if child is not None and hasattr(child, "_checkpoint_wrapped_module"):
                return child
    return None


def wrapper_checkpointing_error(wrapper: nn.Module) -> ValueError:
    """The one message for a policy combined with torch's ``checkpoint_wrapper`` (Accelerate's FSDP
    activation checkpointing)."""
    inner = type(getattr(wrapper, "_checkpoint_wrapped_module", wrapper)).__name__
    return ValueError(
        f"activation checkpointing twice: {inner} is wrapped by torch's checkpoint_wrapper ({type(wrapper).__name__}, "
        "what Accelerate's FSDP activation checkpointing and torch's apply_activation_checkpointing install) and an "
        "ac_policies policy wraps modules in the same model, so they would be recomputed twice. Use one: to keep the "
        "policy, turn Accelerate's off: fsdp_activation_checkpointing: false in the Accelerate config file, "
        "fsdp_config={'activation_checkpointing': False} in TrainingArguments / SFTConfig, or "
        "FullyShardedDataParallelPlugin(activation_checkpointing=False); or remove the policy with handle.remove()."
    )


def _lineage(model: nn.Module, fqn: str) -> list[tuple[str, nn.Module]]:
    """The module, its ancestors (closest first), then its descendants, by name: where another
    checkpointing mechanism around, on or under it shows up."""
    parts = fqn.split(".") if fqn else []
    chain = [".".join(parts[:k]) for k in range(len(parts), -1, -1)]
    found = [(a, model.get_submodule(a)) for a in chain]
    return found + [(f"{fqn}.{n}" if fqn else n, m) for n, m in model.get_submodule(fqn).named_modules() if n]


def _related(lineage: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The modules of ``lineage`` carrying an HF ``gradient_checkpointing`` flag; the first one
    switched on names the double checkpointing."""
    return [(n, m) for n, m in lineage if hasattr(m, "gradient_checkpointing")]


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


def _run_offloaded(module: nn.Module, fqn: str, orig: Callable, args: tuple, kwargs: dict) -> Any:
    """Run ``orig`` offloading its saved activations when the module is on CUDA, else as is (one warning)."""
    device = _module_device(module, args, kwargs)
    if device is None or device.type != "cuda":
        if not _offload_warned:
            _warn_offload_in_place(fqn, device)
        return orig(*args, **kwargs)
    return _offloaded(module, orig, args, kwargs)


def _make_forward(module: nn.Module, row: PlanRow, orig: Callable, related: list[tuple[str, nn.Module]],
                  lineage: list[nn.Module]) -> Callable:
    action = row.action
    # torch.compile traces checkpoint's context_fn only when one is given, so pass none for plain checkpoint
    extra: dict[str, Any] = {}
    if action == "selective":
        extra["context_fn"] = selective_context_fn(row.selective or SelectiveOps())
    fqn = row.fqn
    region = compile_safe(module, fqn, orig)

    def forward(*args: Any, **kwargs: Any) -> Any:
        # as Hugging Face does: no region in eval mode (cached decoding) or without gradients (no backward)
        if not (module.training and torch.is_grad_enabled()):
            return orig(*args, **kwargs)
        flagged = _hf_flagged(related)
        if flagged is not None:
            raise double_checkpointing_error(*flagged)
        wrapper = _checkpoint_wrapped(lineage)
        if wrapper is not None:
            raise wrapper_checkpointing_error(wrapper)
        if action == "offload":
            return _run_offloaded(module, fqn, orig, args, kwargs)
        fn = cache_safe(module, fqn, region, args, kwargs) if has_cache(args, kwargs) else region
        # keyword arguments go to the module through a partial, never to checkpoint itself: names such as
        # `debug`, `early_stop`, `function` or `context_fn` would otherwise be taken as checkpoint options
        return checkpoint(functools.partial(fn, **kwargs), *args, use_reentrant=False, preserve_rng_state=True, **extra)

    functools.update_wrapper(forward, orig, updated=())
    setattr(forward, _MARK, row)
    return forward


def apply_policy(model: nn.Module, policy: PolicyLike, *, strict: bool = False) -> PolicyHandle:
    """Apply ``plan(model, policy, strict=strict)`` and return a handle that undoes it.

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
    wrapper = _checkpoint_wrapped(list(model.modules()))
    if wrapper is not None:
        raise wrapper_checkpointing_error(wrapper)
    lineages = {row.fqn: _lineage(model, row.fqn) for row in p.wrapped}
    related = {fqn: _related(lineage) for fqn, lineage in lineages.items()}
    for row in p.wrapped:
        flagged = _hf_flagged(related[row.fqn], training=False)
        if flagged is not None:
            raise double_checkpointing_error(*flagged)
    changes: list[tuple[nn.Module, PlanRow, Any, Callable]] = []
    for row in p.wrapped:
        module = model.get_submodule(row.fqn)
        previous = module.__dict__.get("forward", _MISSING)
        ours = _make_forward(module, row, module.forward, related[row.fqn],
                             [m for _, m in lineages[row.fqn]])
        module.__dict__["forward"] = ours
        changes.append((module, row, previous, ours))
        logger.info("ac_policies: %s (%s) -> %s  [rule %d: %s]", row.fqn or "<root>", row.module_type, row.action, row.rule_index, row.rule)
    logger.info("ac_policies: applied %s to %s: %d module(s) wrapped", p.policy.name or "custom table", p.model_type, len(changes))
    return PolicyHandle(p, changes)
