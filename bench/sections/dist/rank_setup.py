"""What every rank's ``dist`` setup shares: the dtypes by name, the mesh's device, the labels,
and a backward that clears the leaves' gradients.

A setup runs in each rank (see :mod:`bench.sections.dist.worker`), takes the device mesh and its shape as
keyword arguments and returns ``(forward, backward)``: ``forward()`` gives the loss,
``backward(loss)`` backpropagates it and leaves the inputs ready for the next step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: A setup's name, ``"module:function"``, and the keyword arguments it adds to the shape.
Variants = dict[str, tuple[Callable[..., Any], dict[str, Any]]]


def mesh_device(mesh: Any) -> torch.device:
    """This rank's device on ``mesh``: its current CUDA device, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def seeded_labels(mesh: Any, n: int, v: int) -> torch.Tensor:
    """``[n]`` labels below ``v``, the same on every rank."""
    return torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1234)).to(mesh_device(mesh))


def backward_then_clear(*leaves: torch.Tensor) -> Callable[[Any], None]:
    """``backward(loss)``: backpropagate, then drop the leaves' gradients for the next step."""

    def backward(loss: Any) -> None:
        loss.backward()
        for leaf in leaves:
            leaf.grad = None

    return backward
