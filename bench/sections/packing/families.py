"""Per-family packing outcome for the ``packing`` section: covered, made correct, or refused and why.

For each family: the max |packed logits - each document alone| with stock Transformers, then
the outcome under ``enable_packing(model=...)`` and under plain ``enable_packing()`` (the
forward-time guard), with the patched gap or the reason of the refusal. Reuses
:func:`model_patches.testing.family_sweep.sweep_family`, which the tests run over every family.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from bench.harness.report import Table

#: The default rows: the tested families, ALiBi, stateful mixers, masks built elsewhere.
DEFAULT_SWEEP = [
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_moe", "mixtral", "qwen2_moe",
    "gemma2", "phi3", "olmo2", "deepseek_v2", "gpt2", "falcon", "falcon+alibi", "bloom", "mpt",
    "jamba", "bamba", "falcon_h1", "qwen3_next", "lfm2", "zamba2", "granitemoehybrid",
    "nemotron_h", "mamba", "mamba2", "falcon_mamba", "rwkv", "cpmant",
]


def _verdict(result: Any) -> str:
    """covered / made correct (capabilities) / refused / LEAK / not built, for one table cell."""
    if result.outcome == "correct":
        return f"made correct ({', '.join(result.made_correct)})" if result.made_correct else "covered"
    return {"refused": "refused", "leak": "LEAK", "not built": "not built"}[result.outcome]


def family_table(args: argparse.Namespace, command: str, tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    import transformers

    from model_patches.testing.family_sweep import causal_lm_families, sweep_family

    names = causal_lm_families() if args.packing_sweep == ["all"] else args.packing_sweep
    rows, data = [], {}
    for name in names:
        family, _, extra = name.partition("+")
        overrides = {extra: True} if extra else {}
        tick(f"packing sweep {name}")
        with_model = sweep_family(family, use_model=True, with_stock=True, **overrides)
        plain = sweep_family(family, use_model=False, **overrides)
        if with_model.outcome == "not built" and plain.outcome == "not built":
            data[name] = {"outcome": "not built", "detail": with_model.detail}
            continue
        reason = next((r.detail for r in (with_model, plain) if r.outcome == "refused"), "")
        rows.append([
            name, with_model.stock_gap, _verdict(with_model), _verdict(plain), with_model.gap, reason[:110],
        ])
        data[name] = {"model=": with_model.outcome, "plain": plain.outcome, "stock": with_model.stock_gap,
                      "patched": with_model.gap, "reason": reason, "made_correct": list(with_model.made_correct)}
    counts = {o: sum(1 for r in rows if r[2].startswith(o)) for o in ("covered", "made correct", "refused", "LEAK")}
    table = Table(
        title="packing per family: covered, made correct or refused (never a silent leak)",
        columns=["family", "stock gap", "enable_packing(model=)", "enable_packing()", "patched gap", "refused because"],
        rows=rows, command=command, baseline="stock Transformers (same batch, same run)",
        notes=[
            f"transformers {transformers.__version__}; tiny random-init fp32 models on each family's default "
            "attention backend; gap = max |packed logits - each document alone| (target <= 1e-4)",
            "covered: masked attention is the only sequence mixer and its masks are patched; made correct: "
            "also an ALiBi bias or a stateful mixer, which packing makes per-document (named)",
            f"{counts['covered']} covered, {counts['made correct']} made correct, {counts['refused']} refused, "
            f"{counts['LEAK']} silent leaks; "
            f"{len(names) - len(rows)} families not buildable at tiny size on CPU left out",
            "--packing-sweep all runs every AutoModelForCausalLM family of the installed release",
        ],
    )
    return table, data
