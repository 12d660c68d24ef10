"""Vocabulary-parallel cross-entropy from hidden states: ``hidden [N, H]`` on every rank and a
column-parallel LM head ``[V, H]``, forward + backward on every rank:

  - ``ColwiseParallel lm_head + loss_parallel``: ``F.cross_entropy(lm_head(hidden).float())``
    under ``loss_parallel()``, the baseline;
  - ``functional_ce.linear_cross_entropy`` on the DTensor weight.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bench.sections.dist.rank_setup import DTYPES, Variants, backward_then_clear, mesh_device, seeded_labels

HIDDEN_BASELINE = "ColwiseParallel lm_head + loss_parallel"


def _column_parallel_head(mesh: Any, h: int, v: int, dtype: str) -> torch.nn.Linear:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    head = torch.nn.Linear(h, v, bias=False).to(device=mesh_device(mesh), dtype=DTYPES[dtype])
    head.weight.data.mul_(2.0)  # logits of standard deviation about 2, as in the logits form
    return parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))


def _hidden(mesh: Any, n: int, h: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, h, generator=g).to(device=mesh_device(mesh), dtype=DTYPES[dtype]).requires_grad_()


def setup_colwise_loss_parallel(
    *, mesh: Any, n: int, h: int, v: int, dtype: str, **_: Any
) -> tuple[Callable, Callable]:
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    head = _column_parallel_head(mesh, h, v, dtype)
    hidden = _hidden(mesh, n, h, dtype)
    labels = distribute_tensor(seeded_labels(mesh, n, v), mesh, [Replicate()])

    def forward() -> Any:
        with loss_parallel():
            return F.cross_entropy(head(hidden).float(), labels)

    def backward(loss: Any) -> None:
        with loss_parallel():
            loss.backward()
        head.weight.grad = hidden.grad = None

    return forward, backward


def setup_ours_hidden(*, mesh: Any, n: int, h: int, v: int, dtype: str, **_: Any) -> tuple[Callable, Callable]:
    import functional_ce
    from torch.distributed.tensor import DTensor, Replicate

    head = _column_parallel_head(mesh, h, v, dtype)
    hidden = DTensor.from_local(_hidden(mesh, n, h, dtype).detach(), mesh, [Replicate()], run_check=False)
    hidden.requires_grad_()
    labels = seeded_labels(mesh, n, v)
    forward = lambda: functional_ce.linear_cross_entropy(hidden, head.weight, labels)  # noqa: E731
    return forward, backward_then_clear(head.weight, hidden)


HIDDEN_VARIANTS: Variants = {
    HIDDEN_BASELINE: (setup_colwise_loss_parallel, {}),
    "functional_ce.linear_cross_entropy": (setup_ours_hidden, {}),
}
