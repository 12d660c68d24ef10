"""One step of a 2-stage pipeline (GPipe, 4 microbatches), the last stage's ``loss_fn``:

  - ``F.cross_entropy(logits.float())``: the baseline;
  - ``functional_ce`` with ``inplace_grad=True`` (and ``return_outputs=False``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bench.sections.dist.rank_setup import DTYPES, Variants, mesh_device

PIPELINE_BASELINE = "F.cross_entropy(logits.float())"


def setup_pipeline(*, mesh: Any, n: int, h: int, v: int, dtype: str, library: bool = False,
                   **_: Any) -> tuple[Callable, Callable]:
    """A 2-stage GPipe step (4 microbatches) of a small LM (embedding and a layer | a layer and
    the LM head): ``F.cross_entropy(logits.float())`` as the last stage's loss, or with
    ``library`` ``functional_ce.cross_entropy`` with ``inplace_grad=True`` (``return_outputs=False``).
    Both sum over the microbatch and divide by the global label count (``scale_grads=False``)."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed import pipelining as pp

    import functional_ce

    rank, device = mesh.get_local_rank(0), mesh_device(mesh)
    torch.manual_seed(0)
    first = nn.Sequential(nn.Embedding(v, h), nn.Linear(h, h), nn.Tanh())
    last = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, v))
    module = (first if rank == 0 else last).to(device=device, dtype=DTYPES[dtype])
    stage = pp.PipelineStage(module, rank, 2, device, group=mesh.get_group())
    seq = min(n, 512)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, v, (max(4, n // seq), seq), generator=g).to(device)
    count = ids.numel()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if library:
            return functional_ce.cross_entropy(out, target, reduction="sum", num_label_tokens=count,
                                               inplace_grad=True)
        return F.cross_entropy(out.float().flatten(0, 1), target.flatten(), reduction="sum") / count

    schedule = pp.ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)

    def forward() -> None:  # the schedule runs forward and backward in one call
        schedule.step(*((ids,) if rank == 0 else ()), target=ids if rank == 1 else None, return_outputs=False)

    def backward(_: Any) -> None:
        module.zero_grad(set_to_none=True)

    return forward, backward


PIPELINE_VARIANTS: Variants = {
    PIPELINE_BASELINE: (setup_pipeline, {}),
    "functional_ce inplace, return_outputs=False": (setup_pipeline, {"library": True}),
}
