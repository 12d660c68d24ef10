"""A dispatch mode that records the shape and dtype of every tensor an operator returns, and
counts matmul FLOPs.

Custom operators of ``functional_ce`` are opened up: their Python implementation runs under
the same mode, so allocations and matmuls inside the chunk loops are seen too (torch's own
``FlopCounterMode`` sees each operator as one opaque call). Compiled chunk graphs do not run
under a dispatch mode: the chunk maths runs eagerly there. For an operator on DTensors the mode
steps aside, so what is recorded are the local tensors each process allocates.

:func:`trace_forward_and_backward` traces a loss's forward and its backward separately;
:func:`saved_for_backward` lists what autograd keeps from a forward for the backward.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from functional_ce.operators import IMPLEMENTATIONS

T = TypeVar("T")

# Operators whose outputs are views or the mutated input, not new storage.
_NO_ALLOC = {"aten::view", "aten::_unsafe_view", "aten::slice", "aten::select", "aten::unsqueeze",
             "aten::squeeze", "aten::reshape", "aten::expand", "aten::t", "aten::transpose",
             "aten::permute", "aten::alias", "aten::detach", "aten::as_strided", "aten::copy_",
             "aten::fill_", "aten::zero_", "aten::lift_fresh"}


class AllocationTrace(TorchDispatchMode):
    """``records``: ``(op name, shape, dtype)`` of each new tensor an operator returned;
    ``flops``: FLOPs of the matmuls (and other ops torch's FLOP counter knows) that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if _has_dtensor(types):
            return NotImplemented  # let DTensor run first; its local operators come back here
        name = func._schema.name
        impl = IMPLEMENTATIONS.get(name)
        if impl is not None:
            with self:
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        self.flops += _flops(name, func, args, kwargs, out)
        if name not in _NO_ALLOC and not name.endswith("_"):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.records.append((name, tuple(t.shape), t.dtype))
        return out

    def largest(self) -> int:
        return max((_numel(shape) for _, shape, _ in self.records), default=0)

    def with_numel(self, numel: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [r for r in self.records if _numel(r[1]) == numel]


def trace_forward_and_backward(forward: Callable[[], torch.Tensor]) -> tuple[AllocationTrace, AllocationTrace]:
    """``(trace of forward(), trace of the scalar loss's backward())``."""
    with AllocationTrace() as fwd:
        loss = forward()
    with AllocationTrace() as bwd:
        loss.backward()
    return fwd, bwd


def saved_for_backward(forward: Callable[[], T]) -> tuple[T, list[torch.Tensor]]:
    """``(forward(), every tensor autograd saved for the backward during the call)``."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, saved


#: Matmul-like operators as a Python mode sees them (composite ones are not decomposed there):
#: position of the argument whose last dim is the contracted one.
_CONTRACTING_ARG = {"aten::mm": 0, "aten::matmul": 0, "aten::linear": 0, "aten::addmm": 1, "aten::addmm_": 1}


def _flops(name: str, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    if name in _CONTRACTING_ARG and isinstance(out, torch.Tensor):
        return 2 * out.numel() * args[_CONTRACTING_ARG[name]].shape[-1]
    count = flop_registry.get(func._overloadpacket)
    return 0 if count is None else int(count(*args, **kwargs, out_val=out))


def _has_dtensor(types: Any) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(issubclass(t, DTensor) for t in types)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
