"""Pipeline parallelism (``torch.distributed.pipelining``) whose last stage emits hidden states and
whose ``loss_fn`` applies the LM head with ``functional_ce.pipeline_loss_fn``, so the last stage
never builds logits. Two CPU processes with gloo, a GPipe schedule of 4 microbatches.

    python examples/pipeline_last_stage.py --tiny
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import functional_ce

VOCAB, HIDDEN, BATCH, LENGTH, MICROBATCHES = 97, 32, 8, 16, 4


class FirstStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(self.embed(ids)))


class LastStage(nn.Module):
    """Emits hidden states; holds the LM head (not called) so that the schedule scales and
    reduces its gradient with the stage's other parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(x))


def worker(rank: int, steps: int, port: int) -> None:
    from torch.distributed import pipelining as pp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = FirstStage() if rank == 0 else LastStage()
    stage = pp.PipelineStage(module, rank, 2, torch.device("cpu"))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    # Every position but each row's last has a label: the step's label count is fixed. The loss is
    # the sum over that global count, so the schedule's own scaling is off.
    count = BATCH * (LENGTH - 1)
    if rank == 1:
        loss_fn = functional_ce.pipeline_loss_fn(module.lm_head, reduction="sum", num_label_tokens=count)
    else:  # every stage needs a loss_fn for the schedule to run backward; only the last one calls it
        loss_fn = functional_ce.pipeline_loss_fn(nn.Linear(HIDDEN, VOCAB, bias=False))
    schedule = pp.ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=False)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g)
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # position t predicts t+1
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=labels, losses=losses, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 1:
            loss = sum(x.item() for x in losses)  # the step's mean loss over its label tokens
            assert math.isfinite(loss)
            print(f"step {step}: loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="3 steps")
    parser.add_argument("--port", type=int, default=29527)
    args = parser.parse_args()
    mp.spawn(worker, args=(3 if args.tiny else 100, args.port), nprocs=2, join=True)
    print("loss: finite on every step")


if __name__ == "__main__":
    main()
