"""One FSDP2 training step of a 2-layer Llama, ``fully_shard`` on each decoder layer and the
root, each rank on its own batch:

  - ``model(**batch).loss``: the model's own loss, the baseline;
  - ``model_patches.causal_lm_loss``: the hidden-state loss inside the root's FSDP2 call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bench.sections.dist.rank_setup import DTYPES, Variants, mesh_device

FSDP_BASELINE = "model(**batch).loss"


def _fsdp_llama(mesh: Any, hidden: int, vocab: int, dtype: str) -> Any:
    """A 2-layer Llama with random weights, ``fully_shard`` on each decoder layer and the root."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).to(mesh_device(mesh)).train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def setup_fsdp_model_loss(*, mesh: Any, n: int, h: int, v: int, dtype: str, library: bool = False,
                          **_: Any) -> tuple[Callable, Callable]:
    """One training step of an FSDP2 Llama on this rank's ``[n / 512, 512]`` batch: the model's own
    loss, or ``model_patches.causal_lm_loss`` with ``library``."""
    from model_patches import causal_lm_loss

    model = _fsdp_llama(mesh, h, v, dtype)
    g = torch.Generator().manual_seed(100 + mesh.get_local_rank(0))
    ids = torch.randint(0, v, (max(1, n // 512), min(n, 512)), generator=g).to(mesh_device(mesh))
    batch = {"input_ids": ids, "labels": ids}

    def forward() -> Any:
        return causal_lm_loss(model, **batch) if library else model(**batch).loss

    def backward(loss: Any) -> None:
        loss.backward()
        model.zero_grad(set_to_none=True)

    return forward, backward


FSDP_VARIANTS: Variants = {
    FSDP_BASELINE: (setup_fsdp_model_loss, {}),
    "model_patches.causal_lm_loss": (setup_fsdp_model_loss, {"library": True}),
}
