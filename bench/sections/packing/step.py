"""Compiled training step on a packed batch, with and without ``enable_packing`` (a ``bench.harness.measure`` variant).

:func:`setup` builds a small random-init model (hidden 128, 2 layers, vocab 1024: Llama, or a
Qwen3-Next with one gated-delta-net layer and one attention layer, see :data:`STEP_MODELS`), a
batch of 4 rows x 512 tokens packed by ``PackingCollator`` from documents of 8-300 tokens,
compiles the model with ``torch.compile`` and returns one forward + backward step. Without
``enable_packing`` the same indexed batch runs through stock Transformers (documents leak; this is
the speed baseline only); with it, Llama is compiled with ``fullgraph=True`` and Qwen3-Next runs
its mixer per document (graph breaks around the layout read, see ``model_patches.packing.document_mixers``).
"""

from __future__ import annotations

import random
from typing import Any, Callable

import torch


def packed_llama_batch(rows: int = 4, length: int = 512, vocab: int = 1024, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` x ``length`` tokens of random documents (8-300 tokens) packed by ``PackingCollator``."""
    from model_patches import PackingCollator

    rng = random.Random(seed)
    docs, total = [], 0
    while total < rows * length * 0.97:
        n = rng.randint(8, 300)
        docs.append([rng.randrange(3, vocab) for _ in range(n)])
        total += n
    # built before enable_packing: the stock run of this same batch is the speed baseline (it leaks)
    batch = PackingCollator(length, require_packing=False)(docs)
    return {k: v[:rows] for k, v in batch.items()}


#: Step-table models: (model_type, extra config). Qwen3-Next has one gated-delta-net layer
#: (a stateful mixer, run per document under packing) and one attention layer.
STEP_MODELS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3_next": dict(
        layer_types=["linear_attention", "full_attention"], head_dim=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    ),
}


def setup(device: str = "cpu", packing: bool = True, backend: str = "inductor",
          implementation: str = "sdpa", model_type: str = "llama") -> Callable[[], Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_patches import enable_packing

    config = AutoConfig.for_model(
        model_type, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, **STEP_MODELS[model_type],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).to(device).train()
    batch = {k: v.to(device) for k, v in packed_llama_batch().items()}
    if packing:
        enable_packing(model=model)  # left on for the child process's lifetime
    # per-document mixers read the document layout outside the graph: fullgraph only without them
    compiled = torch.compile(model, backend=backend, fullgraph=packing and model_type == "llama")

    def step() -> None:
        out = compiled(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def step_table(args: Any, command: str, tick: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """Median compiled step time, stock vs ``enable_packing`` (each in its own process)."""
    import transformers

    from bench.harness.measure import measure
    from bench.harness.report import Table, ratio

    rows, data, spread = [], {}, {}
    for model_type in args.packing_step_models:
        results = {}
        for packing in (False, True):
            tick(f"packing compiled step, {model_type}, enable_packing={packing}")
            results[packing] = measure(
                setup,
                {"packing": packing, "backend": args.packing_step_backend, "model_type": model_type},
                warmup=2, repeats=args.packing_step_repeats,
            )
        base, packed = results[False], results[True]
        how = "fullgraph=True" if model_type == "llama" else "mixers per document"
        rows += [
            [model_type, "stock Transformers (documents leak)", base.ms, 1.0 if base.ms else None, base.error or ""],
            [model_type, f"enable_packing(model=...), {how}", packed.ms, ratio(packed.ms, base.ms), packed.error or ""],
        ]
        data[model_type] = {"stock_ms": base.ms, "packing_ms": packed.ms}
        for (_, variant, *_), m in zip(rows[-2:], (base, packed)):
            if m.spread is not None:
                spread[f"{model_type} / {variant}"] = m.spread
    table = Table(
        title=f"compiled training step (forward + backward), packed batch 4 x 512, torch.compile backend={args.packing_step_backend}",
        columns=["model", "variant", "step (ms)", "x stock", "error"], rows=rows, command=command, keys=2,
        spread=spread,
        baseline="stock Transformers on the same packed batch",
        notes=[
            f"transformers {transformers.__version__}; hidden 128, 2 layers, vocab 1024, sdpa, fp32 (qwen3_next: "
            "one gated-delta-net layer, one attention layer, 4 experts); "
            f"median of {args.packing_step_repeats} steps after 2 warm-up steps (compilation excluded), "
            "each variant in its own process",
        ],
    )
    return table, data
