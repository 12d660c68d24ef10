"""Measure what a policy does: bytes kept for backward and FLOPs (with grouped-GEMM experts).

- :func:`kept_for_backward` runs a forward and reports the activation bytes still alive when
  it returns, two ways: storages produced by forward ops that are still referenced (by autograd
  or by checkpoint's saved inputs and selective cache), and the bytes autograd packed through
  saved-tensor hooks (what a hook-based offloader would see; tensors saved *inside* a
  checkpoint region are recomputed, so the hooks never see them).
- :func:`step_bytes` runs forward and backward and reports the bytes kept when forward returns
  next to the step peak: the most activation bytes alive at once over forward plus backward
  (recompute, activation gradients and backward temporaries included). The peak is what
  decides out-of-memory; kept bytes only bound the memory held between forward and backward.
- :func:`flop_counter` is ``FlopCounterMode`` that also counts ``aten._grouped_mm`` (the op
  Hugging Face MoE experts run by default) and the CPU flash-attention kernels, which torch's
  counter does not know.
- :func:`step_cost` is both in one step: the step peak and what backward recomputes (FLOPs and
  op calls; pointwise ops have no FLOP formula, so a ``selective`` region shows in the calls).
- :func:`recompute_flops` counts the FLOPs a backward pass spends re-running forward code:
  ops that run with grad mode on during ``backward()`` (the engine runs gradient formulas with
  grad mode off; checkpoint recomputes with it on), split by whether they run inside a chosen
  set of modules (the MoE blocks).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils import flop_counter as _fc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

from .accounting import LiveBytes, OpOutputs, measured_device, storage_key

__all__ = [
    "KeptBytes", "StepBytes", "StepCost", "kept_for_backward", "step_bytes", "step_cost", "flop_counter",
    "grouped_mm_flop", "recompute_flops",
]


def grouped_mm_flop(a_shape, b_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    """FLOPs of ``_grouped_mm(a, b, offs)``: 2 x output elements x contracted size.

    For 2-D x 2-D (the weight gradient) the output is ``[groups, m, n]`` but each group only
    contracts its own slice of ``k``, so the group count does not multiply.
    """
    k = a_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[-2] * out_shape[-1] * k
    return 2 * math.prod(out_shape) * k


def _sdpa_flop(q_shape, k_shape, v_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return _fc.sdpa_flop_count(q_shape, k_shape, v_shape)


def _sdpa_backward_flop(g_shape, q_shape, k_shape, v_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
    return _fc.sdpa_backward_flop_count(g_shape, q_shape, k_shape, v_shape)


def _extra_formulas(wrapped: bool) -> dict:
    """Formulas torch's registry lacks: grouped GEMM and the CPU flash-attention pair.

    ``wrapped``: shape-wrapped (as in ``flop_registry``) or raw (for ``custom_mapping``).
    """
    aten = torch.ops.aten
    raw: dict = {}
    if hasattr(aten, "_grouped_mm"):
        raw[aten._grouped_mm] = grouped_mm_flop
    # same leading (q, k, v) / (grad_out, q, k, v) arguments as the CUDA flash kernels
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        raw[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flop
        raw[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_backward_flop
    return {k: shape_wrapper(v) for k, v in raw.items()} if wrapped else raw


def flop_counter(**kwargs: Any) -> FlopCounterMode:
    """``FlopCounterMode(display=False, ...)`` that also counts grouped GEMMs and CPU flash attention."""
    mapping = {**_extra_formulas(wrapped=False), **dict(kwargs.pop("custom_mapping", {}))}
    kwargs.setdefault("display", False)
    return FlopCounterMode(custom_mapping=mapping, **kwargs)


_PRIM_DEVICE = torch.ops.prim.device.default


class _RecomputeFlops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.registry = {**flop_registry, **_extra_formulas(wrapped=True)}
        self.in_backward = False
        self.inside = 0  # depth of calls into the watched modules
        self.total = 0
        self.watched = 0
        self.ops = 0  # recomputed op calls, FLOP formula or not

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # prim.device: fake tensors answer `.device` through dispatch; no computation
        if self.in_backward and torch.is_grad_enabled() and func is not _PRIM_DEVICE:
            self.ops += 1
            formula = self.registry.get(func._overloadpacket)
            if formula is not None:
                n = formula(*args, **kwargs, out_val=out)
                self.total += n
                self.watched += n if self.inside else 0
        return out


def recompute_flops(
    model: nn.Module, forward: Callable[[], torch.Tensor], watched: Iterable[str] = ()
) -> tuple[int, int]:
    """``(all, watched)`` FLOPs recomputed during ``forward().backward()``.

    ``watched`` are fully qualified module names; FLOPs of ops run inside any of them (or their
    descendants, called as modules) count in the second number.
    """
    mode = _RecomputeFlops()
    names = list(watched)
    subtree = {id(m) for n in names for m in model.get_submodule(n).modules()}
    hooks = []

    def enter(mod, args):
        mode.inside += 1

    def leave(mod, args, out):
        mode.inside -= 1

    for m in model.modules():
        if id(m) in subtree:
            hooks.append(m.register_forward_pre_hook(enter))
            # always_call: checkpoint's early stop ends a recompute by raising inside a module
            hooks.append(m.register_forward_hook(leave, always_call=True))
    try:
        loss = forward()
        with mode:  # only backward runs under the mode: forward is never counted
            mode.in_backward = True
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return mode.total, mode.watched


@dataclasses.dataclass(frozen=True)
class KeptBytes:
    """Activation bytes alive after forward (``live``) and packed by saved-tensor hooks (``saved``)."""

    live: int
    saved: int


def kept_for_backward(model: nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, KeptBytes]:
    """Run ``forward()`` (returning the loss) and measure what it keeps for backward.

    Parameters and buffers are excluded; so is the returned loss. The caller runs backward.
    """
    owned = {storage_key(p) for p in model.parameters()}
    owned |= {storage_key(b) for b in model.buffers()}
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in owned:
            packed[st._cdata] = st.nbytes()
        return t

    mode = OpOutputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mode:
        loss = forward()
    gc.collect()
    loss_ptr = storage_key(loss)
    live = sum(n for key, (ref, n) in mode.refs.items() if not ref.expired() and key not in owned and key != loss_ptr)
    saved = sum(n for key, n in packed.items() if key != loss_ptr)
    return loss, KeptBytes(live=live, saved=saved)


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Activation bytes of one training step: alive when forward returns, and the highest alive
    at any op boundary over forward plus backward (the step peak, what decides out-of-memory)."""

    kept: int
    peak: int


def step_bytes(model: nn.Module, forward: Callable[[], torch.Tensor]) -> StepBytes:
    """Run ``forward()`` (returning the loss) and its backward; activation bytes kept and at the peak.

    Parameters, buffers and parameter gradients are excluded: gradients are allocated (zeros)
    before the step and accumulated into, so only the transient gradient outputs of backward
    ops count. Everything else an op produces (activations, what checkpointing saves or
    recomputes, activation gradients) counts while it is alive; on an accelerator, only what
    lives on it (host copies of offloaded activations do not count).
    """
    cost = _step(model, forward, None)
    return StepBytes(kept=cost.kept, peak=cost.peak)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One training step: activation bytes kept after forward and at the step peak (as
    :class:`StepBytes`), and what backward recomputed: FLOPs (ops with a FLOP formula) and op
    calls (every op run with grad mode on during backward)."""

    kept: int
    peak: int
    recompute_flops: int
    recompute_ops: int


def step_cost(model: nn.Module, forward: Callable[[], torch.Tensor]) -> StepCost:
    """:func:`step_bytes` and :func:`recompute_flops` of one ``forward().backward()``, in one run
    (parameter gradients are allocated first, as :func:`step_bytes` does)."""
    return _step(model, forward, _RecomputeFlops())


def _step(model: nn.Module, forward: Callable[[], torch.Tensor], counted: Optional[_RecomputeFlops]) -> StepCost:
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    owned = {storage_key(t) for t in [*model.parameters(), *model.buffers()]}
    owned |= {storage_key(p.grad) for p in model.parameters() if p.grad is not None}
    live = LiveBytes(owned, measured_device(model))
    gc.freeze()  # the collection after forward then scans only what forward made (fast in a large process)
    try:
        with live:
            loss = forward()
        gc.collect()
    finally:
        gc.unfreeze()
    loss_ptr = storage_key(loss)
    kept = sum(n for key, (ref, n) in live.refs.items() if not ref.expired() and key != loss_ptr)
    if counted is None:
        with live:
            loss.backward()
    else:
        counted.in_backward = True
        with live, counted:
            loss.backward()
    del loss
    return StepCost(kept=kept, peak=live.peak, recompute_flops=counted.total if counted else 0,
                    recompute_ops=counted.ops if counted else 0)
