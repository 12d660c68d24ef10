"""Peak memory of one training step per process under Accelerate's FSDP2, stock loss against
``enable_linear_cross_entropy``, 2 CPU processes (Accelerate's FSDP choice overridden on CPU as in
``bench/harness/engines.py``). Resident-set peak above the resident set before the step.

    python -m bench.sections.dist.accelerate_step
"""

from __future__ import annotations

import sys


def _step(mesh, patched: bool, vocab: int, tokens: int) -> dict:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import model_patches
    from bench.harness import engines
    from bench.harness.rss_peak import peak_extra_bytes
    from model_patches.testing.tiny_models import tiny_loss_model

    engines.distributed_env(dist.get_rank(), dist.get_world_size())
    engines.reset_accelerate()
    model = tiny_loss_model("llama", vocab_size=vocab)
    if patched:
        model_patches.enable_linear_cross_entropy(model)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    with engines.accelerate_fsdp_on_cpu():
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        model = accelerator.prepare(model)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, vocab, (1, tokens), generator=g)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss)

    step()  # warm: gradients allocated
    loss, peak = peak_extra_bytes(step)
    return {"loss": loss, "peak": peak, "logits_fp32": tokens * vocab * 4,
            "type": str(accelerator.distributed_type)}


def main(vocab: int = 32000, tokens: int = 2048) -> None:
    from bench.harness.dist_pool import DistPool

    pool = DistPool(2)
    try:
        rows = {name: pool.run(_step, (2,), name == "hidden_state_loss", vocab, tokens)
                for name in ("stock", "hidden_state_loss")}
    finally:
        pool.close()
    print(f"vocab {vocab}, {tokens} tokens per process; fp32 logits {tokens * vocab * 4 / 2**20:.0f} MiB")
    for name, results in rows.items():
        for rank, r in enumerate(results):
            print(f"{name:18s} rank {rank} {r['type']}: step peak above baseline {r['peak'] / 2**20:8.1f} MiB, loss {r['loss']:.4f}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
