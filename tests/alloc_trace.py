"""A dispatch mode that records the shape and dtype of every tensor an operator returns.

Custom operators of ``functional_ce`` are opened up: their Python implementation runs under
the same mode, so allocations inside the chunk loop are seen too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from functional_ce.ops import IMPLEMENTATIONS

# Operators whose outputs are views or the mutated input, not new storage.
_NO_ALLOC = {"aten::view", "aten::_unsafe_view", "aten::slice", "aten::select", "aten::unsqueeze",
             "aten::squeeze", "aten::reshape", "aten::expand", "aten::t", "aten::transpose",
             "aten::permute", "aten::alias", "aten::detach", "aten::as_strided", "aten::copy_",
             "aten::fill_", "aten::zero_", "aten::lift_fresh"}


class AllocationTrace(TorchDispatchMode):
    """``records``: ``(op name, shape, dtype)`` of each new tensor an operator returned."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        impl = IMPLEMENTATIONS.get(name)
        if impl is not None:
            with self:
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        if name not in _NO_ALLOC and not name.endswith("_"):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.records.append((name, tuple(t.shape), t.dtype))
        return out

    def largest(self) -> int:
        return max((_numel(shape) for _, shape, _ in self.records), default=0)

    def with_numel(self, numel: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [r for r in self.records if _numel(r[1]) == numel]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
