"""Count the bytes each process hands to collectives, by operator, while a block runs.

A dispatch mode sees every collective torch issues: the functional collectives
(``_c10d_functional.*``, what DTensor and the losses use, also inside autograd's backward) and
the classic ``c10d.*`` operators. For an operator on DTensor arguments the mode steps aside
(returns ``NotImplemented``) so that DTensor runs first and the mode sees the collectives it
issues (``loss_parallel``'s, a redistribution's). The payload counted is the size of the tensor
the process contributes (the input of an all-reduce, all-gather or reduce-scatter).

A dispatch mode keeps dynamo from compiling: count bytes in an eager step, not a timed one.
"""

from __future__ import annotations

import collections

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_COLLECTIVES = {
    "all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
    "allreduce_", "allgather_", "_allgather_base_", "reduce_scatter_", "_reduce_scatter_base_", "broadcast_",
    "alltoall_", "alltoall_base_", "all_gather_into_tensor_coalesced", "all_reduce_coalesced",
    "reduce_scatter_tensor_coalesced",
}


class CommBytes(TorchDispatchMode):
    """``with CommBytes() as c: ...`` then ``c.bytes`` (total) and ``c.by_op`` (name -> bytes)."""

    #: Compiled backward graphs call higher-order operators (auto_functionalized): let them through.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = collections.Counter()
        self.calls: dict[str, int] = collections.Counter()

    @property
    def bytes(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        namespace = getattr(func, "namespace", None)
        name = getattr(func, "_opname", None)
        if namespace in ("_c10d_functional", "c10d") and name in _COLLECTIVES:
            first = args[0]
            tensors = [t for t in tree_flatten(first)[0] if isinstance(t, torch.Tensor)]
            self.by_op[name] += sum(t.numel() * t.element_size() for t in tensors)
            self.calls[name] += 1
        return func(*args, **kwargs)
