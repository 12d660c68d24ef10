"""Vocabulary-parallel cross-entropy from logits ``[N, V]`` sharded over the vocabulary
(``Shard(-1)``), forward + backward on every rank:

  - ``loss_parallel + F.cross_entropy``: torch's ``loss_parallel()`` on ``logits.float()``,
    the baseline;
  - ``full_tensor + functional_ce``: gather the logits, then the single-process function;
  - ``functional_ce``: :func:`functional_ce.cross_entropy` on the DTensor; and ``inplace``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bench.sections.dist.rank_setup import DTYPES, Variants, backward_then_clear, mesh_device, seeded_labels

LOGITS_BASELINE = "loss_parallel + F.cross_entropy"


def _sharded_logits(mesh: Any, n: int, v: int, dtype: str) -> Any:
    """A leaf DTensor ``[n, v]`` ``Shard(1)``, each rank's shard seeded by its rank (built
    locally: no rank holds the full logits)."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(0), mesh.get_local_rank(0)
    per = -(-v // world)
    size = max(0, min(v, (rank + 1) * per) - min(v, rank * per))
    g = torch.Generator().manual_seed(rank)
    local = (torch.randn(n, size, generator=g) * 2).to(device=mesh_device(mesh), dtype=DTYPES[dtype])
    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=(n, v), stride=(v, 1)).requires_grad_()


def setup_loss_parallel(*, mesh: Any, n: int, v: int, dtype: str, **_: Any) -> tuple[Callable, Callable]:
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = _sharded_logits(mesh, n, v, dtype)
    labels = distribute_tensor(seeded_labels(mesh, n, v), mesh, [Replicate()])

    def forward() -> Any:
        with loss_parallel():
            return F.cross_entropy(logits.float(), labels)

    def backward(loss: Any) -> None:
        with loss_parallel():
            loss.backward()
        logits.grad = None

    return forward, backward


def setup_gather(*, mesh: Any, n: int, v: int, dtype: str, **_: Any) -> tuple[Callable, Callable]:
    import functional_ce

    logits = _sharded_logits(mesh, n, v, dtype)
    labels = seeded_labels(mesh, n, v)
    return (lambda: functional_ce.cross_entropy(logits.full_tensor(), labels)), backward_then_clear(logits)


def setup_ours(*, mesh: Any, n: int, v: int, dtype: str, inplace: bool = False, **_: Any) -> tuple[Callable, Callable]:
    import functional_ce

    logits = _sharded_logits(mesh, n, v, dtype)
    labels = seeded_labels(mesh, n, v)
    # With inplace_grad each step overwrites the logits with their gradient and the next step
    # reads those values: the work does not depend on them.
    return (lambda: functional_ce.cross_entropy(logits, labels, inplace_grad=inplace)), backward_then_clear(logits)


LOGITS_VARIANTS: Variants = {
    LOGITS_BASELINE: (setup_loss_parallel, {}),
    "full_tensor + functional_ce": (setup_gather, {}),
    "functional_ce": (setup_ours, {}),
    "functional_ce inplace": (setup_ours, {"inplace": True}),
}
