"""Compiled training step on a packed batch, with and without ``enable_packing`` (a ``bench.measure`` variant).

:func:`setup` builds a small random-init Llama (hidden 128, 2 layers, vocab 1024), a batch of
4 rows x 512 tokens packed by ``PackingCollator`` from documents of 8-300 tokens, compiles the
model with ``torch.compile`` and returns one forward + backward step. Without
``enable_packing`` the same indexed batch runs through stock Transformers (documents leak; this is
the speed baseline only); with it, the model is compiled with ``fullgraph=True``.
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
    batch = PackingCollator(length)(docs)
    return {k: v[:rows] for k, v in batch.items()}


def setup(device: str = "cpu", packing: bool = True, backend: str = "inductor",
          implementation: str = "sdpa") -> Callable[[], Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_patches import enable_packing

    config = AutoConfig.for_model(
        "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation).to(device).train()
    batch = {k: v.to(device) for k, v in packed_llama_batch().items()}
    if packing:
        enable_packing(model=model)  # left on for the child process's lifetime
    compiled = torch.compile(model, backend=backend, fullgraph=packing)

    def step() -> None:
        out = compiled(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], labels=batch["labels"], use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def step_table(args: Any, command: str, tick: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """Median compiled step time, stock vs ``enable_packing`` (each in its own process)."""
    import transformers

    from bench.measure import measure
    from bench.report import Table, ratio

    results = {}
    for packing in (False, True):
        tick(f"packing compiled step, enable_packing={packing}")
        results[packing] = measure(
            "bench.packing_step:setup", {"packing": packing, "backend": args.packing_step_backend},
            warmup=2, repeats=args.packing_step_repeats,
        )
    base = results[False]
    rows = [
        ["stock Transformers (documents leak)", base.ms, 1.0 if base.ms else None, base.error or ""],
        ["enable_packing(model=...), fullgraph=True", results[True].ms, ratio(results[True].ms, base.ms), results[True].error or ""],
    ]
    table = Table(
        title=f"compiled training step (forward + backward), packed batch 4 x 512, torch.compile backend={args.packing_step_backend}",
        columns=["variant", "step (ms)", "x stock", "error"], rows=rows, command=command,
        baseline="stock Transformers on the same packed batch",
        notes=[
            f"transformers {transformers.__version__}; Llama hidden 128, 2 layers, vocab 1024, sdpa, fp32; "
            f"median of {args.packing_step_repeats} steps after 2 warm-up steps (compilation excluded), "
            "each variant in its own process",
        ],
    )
    return table, {"stock_ms": base.ms, "packing_ms": results[True].ms}
