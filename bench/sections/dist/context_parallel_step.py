"""One training step of a Llama on one packed row of ``n`` tokens, the row sharded over every
process of the mesh with ``model_patches.enable_context_parallel`` (on one process: the whole row,
the packing patch's document mask). The same total tokens at every process count, so the
per-process peak shows what sharding the sequence saves.

Documents have log-normal lengths (median 512 tokens, as in instruction-tuning data); the loss is
the hidden-state loss (``enable_linear_cross_entropy``), so that the peak is the layers'
activations and the attention masks, not a logits tensor.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from bench.sections.dist.rank_setup import DTYPES, Variants, mesh_device

CP_BASELINE = "one process, whole row"
CP_VARIANT = "enable_context_parallel"


def packed_row(n: int, v: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row of ``n`` tokens: documents of log-normal length (median 512) back to back, the last
    cut at the row's end; ``input_ids``, ``labels`` (-100 on each document's first token) and
    ``position_ids`` ``[1, n]``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, v, (1, n), generator=g)
    positions = torch.empty_like(ids)
    t = 0
    while t < n:
        k = min(int(torch.exp(torch.randn((), generator=g) * 0.8 + 6.24).clamp(8, n)), n - t)
        positions[0, t:t + k] = torch.arange(k)
        t += k
    labels = ids.clone()
    labels[positions == 0] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def setup_context_parallel_step(*, mesh: Any, n: int, h: int, v: int, layers: int, dtype: str,
                                **_: Any) -> tuple[Callable, Callable]:
    """Forward and backward of a ``layers``-layer Llama (hidden ``h``, intermediate ``3 h``, vocabulary
    ``v``) on one packed row of ``n`` tokens: sharded over ``mesh`` when it has several processes
    (gradients summed over it), whole on one."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import model_patches

    config = AutoConfig.for_model(
        "llama", hidden_size=h, intermediate_size=3 * h, num_hidden_layers=layers, num_attention_heads=max(1, h // 64),
        num_key_value_heads=max(1, h // 256), vocab_size=v, max_position_embeddings=max(n, 4096),
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).to(mesh_device(mesh)).train()
    model_patches.enable_linear_cross_entropy(model)
    model_patches.enable_packing()  # kept for the process's life: the bench process ends with the step
    batch = {k: t.to(mesh_device(mesh)) for k, t in packed_row(n, v).items()}
    group = mesh.get_group()
    if mesh.size() > 1:
        inputs = model_patches.enable_context_parallel(model, group).shard(batch)
    else:
        inputs = batch

    def forward() -> Any:
        return model(**inputs).loss

    def backward(loss: Any) -> None:
        loss.backward()
        if mesh.size() > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        model.zero_grad(set_to_none=True)

    return forward, backward


CP_VARIANTS: Variants = {CP_VARIANT: (setup_context_parallel_step, {})}
