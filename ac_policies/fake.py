"""Run a model on fake tensors (``FakeTensorMode``): shapes, dtypes and storages without data, so
a step of a model at full size allocates nothing of its size and runs no real kernel.

:func:`fake_model` swaps every parameter and buffer of a model for a fake copy (CPU, same shape,
stride, dtype and ``requires_grad``; tied parameters stay tied) for the duration of a ``with``
block and puts the originals back after it: a model built on the meta device runs, and a model
with real weights is not modified. Tensors the code creates inside the block are fake too.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["fake_model"]

_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)


class _FakeGaps(TorchDispatchMode):
    """Ops whose fake (meta) kernel refuses what the CPU kernel runs.

    ``aten._grouped_mm`` (Hugging Face MoE experts): the meta kernel takes bf16 only, the CUDA
    kernel's rule; the output shape does not depend on the dtype, so take it from a bf16 call.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket is _GROUPED_MM and args[0].dtype != torch.bfloat16:
            low = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            out = func(*low, **kwargs)
            dtype = kwargs.get("out_dtype") or args[0].dtype
            return torch.empty_strided(out.shape, out.stride(), dtype=dtype, device=out.device)
        return func(*args, **kwargs)


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")


@contextlib.contextmanager
def fake_model(model: nn.Module) -> Iterator[FakeTensorMode]:
    """Within the block, ``model``'s parameters and buffers are fake CPU copies and new tensors are
    fake; on exit the original tensors are back in place (the fake ones and their gradients are
    dropped)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    memo: dict[int, torch.Tensor] = {}
    try:
        with mode, _FakeGaps():
            for module in model.modules():
                for table, make in ((module._parameters, True), (module._buffers, False)):
                    for name, t in list(table.items()):
                        if t is None:
                            continue
                        if id(t) not in memo:
                            fake = _fake_like(t)
                            memo[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if make else fake
                        swapped.append((table, name, t))
                        table[name] = memo[id(t)]
            yield mode
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t
