"""An LM head whose parameters are sharded DTensors (FSDP2) while the hidden states are plain.

Under FSDP2 (``fully_shard``) each parameter is a DTensor sharded on dim 0 over the
data-parallel mesh (``Replicate()`` on an HSDP replicate dim), and activations are plain tensors
that differ per process. A hidden-state loss that takes ``lm_head.weight`` outside the module's
forward sees that sharded DTensor. :func:`gathered_parameter` gives the full parameter for the
step, gathered through DTensor, with its gradient flowing back as DTensor's rules say for a
``Partial`` gradient: summed over the processes and sharded like the parameter (a
reduce-scatter; an all-reduce over replicate dims). The sum is not divided by the number of
processes: FSDP2 divides by it when it reduces gradients itself, this path does not.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

SUPPORTED = "each mesh dim Shard(0) (FSDP2) or Replicate() (an HSDP replicate dim)"


def gathered_parameter(param: Optional[DTensor], what: str) -> Optional[torch.Tensor]:
    """The full local tensor of a sharded parameter, differentiable back to the shards.

    Args:
        param: a DTensor whose placements are ``Shard(0)`` or ``Replicate()`` per mesh dim, or None.
        what: its name in error messages (``"weight"`` / ``"bias"``).

    Returns:
        A plain tensor of ``param``'s global shape (one all-gather); backward turns its gradient
        into ``param``'s placements by a sum over the processes (reduce-scatter / all-reduce).

    Raises:
        ValueError: for a ``Partial`` or any other placement.
    """
    if param is None:
        return None
    for i, p in enumerate(param.placements):
        if not (isinstance(p, Replicate) or (type(p) is Shard and p.dim % param.dim() == 0)):
            raise ValueError(
                f"{what} is a DTensor with placements {tuple(param.placements)} and hidden is a plain tensor "
                f"(the FSDP2 layout): {p!r} on mesh dim {i} is not supported. Supported: {SUPPORTED}; or pass "
                "hidden as a DTensor for the vocabulary-parallel layout"
            )
    mesh = param.device_mesh
    full = param.redistribute(mesh, [Replicate()] * mesh.ndim)
    return full.to_local(grad_placements=[Partial()] * mesh.ndim)
