"""A plain PyTorch training loop on FSDP2 (``fully_shard``) with the LM head's loss computed by
``functional_ce.linear_cross_entropy`` from hidden states: the head's weight stays an FSDP2 shard
between steps and its gradient flows back to the shard. Two CPU processes with gloo.

    python examples/fsdp2_loop.py --tiny
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import functional_ce  # noqa: E402

WORLD = 2


def worker(rank: int, steps: int, port: int) -> None:
    from _tiny import VOCAB, tiny_model
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model)  # the decoder: embeddings and final norm gathered in its own call
    fully_shard(model)  # the root holds the LM head, which the loss uses as a sharded weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)  # each process its own data
    for step in range(steps):
        ids = torch.randint(2, VOCAB, (2, 16), generator=g)
        hidden = model.model(input_ids=ids).last_hidden_state  # FSDP2 gathers each group in its call
        labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)  # position t predicts t+1
        # model.lm_head.weight is a DTensor shard: the full weight is used for the step, its
        # gradient (summed over processes) goes back to the shard
        loss = functional_ce.linear_cross_entropy(hidden, model.lm_head.weight, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            assert math.isfinite(total.item())
            print(f"step {step}: loss {total.item() / WORLD:.4f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="3 steps of a 2-layer model")
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    mp.spawn(worker, args=(3 if args.tiny else 100, args.port), nprocs=WORLD, join=True)
    print("loss: finite on every step")


if __name__ == "__main__":
    main()
