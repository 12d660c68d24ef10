"""The Hugging Face loss path of the ``lce`` section: one training step of a tiny random-init
Llama (in the section's dtype, ``--lce-dtype``; large vocabulary so the logits dominate), forward +
backward:

  - ``model(**batch, labels=...)`` as shipped (Transformers' ``ForCausalLMLoss``), the baseline;
  - the same with ``model_patches.enable_chunked_loss()``;
  - ``model_patches.causal_lm_loss(model, **batch)``.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any, Callable

import torch

from bench.harness.measure import measure
from bench.harness.report import Table, ratio, spreads

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _tiny_llama(v: int, device: str, dtype: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=v, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).to(device).train()


def setup_hf(*, b: int, t: int, v: int, mode: str, device: str, dtype: str = "bf16", **_: Any) -> Callable[[], None]:
    """One loss step of the tiny Llama in ``dtype`` on a ``[b, t]`` batch; ``mode`` (see
    ``HF_VARIANTS``) picks the loss: ``"plain"`` as shipped, ``"record"`` with the chunked loss,
    ``"hidden"`` the library's."""
    import model_patches

    model = _tiny_llama(v, device, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, v, (b, t), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    if mode == "record":
        model_patches.enable_chunked_loss()  # for the life of this child process

    def step() -> None:
        if mode == "hidden":
            loss = model_patches.causal_lm_loss(model, **batch)
        else:
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


HF_VARIANTS = {
    "model(**batch, labels) as shipped": "plain",
    "with enable_chunked_loss()": "record",
    "causal_lm_loss(model, **batch)": "hidden",
}


def measure_hf_table(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[Table, dict[str, Any]]:
    """Each variant's step at ``--lce-hf`` (``B,T,V``), each in its own process, and how much peak
    memory it saves against the step as shipped, in MiB and in fp32 copies of the logits."""
    b, t, v = (int(x) for x in args.lce_hf.split(","))
    results = {}
    for name, mode in HF_VARIANTS.items():
        tick(f"lce hf {mode}")
        results[name] = measure(setup_hf,
                                {"b": b, "t": t, "v": v, "mode": mode, "dtype": args.lce_dtype},
                                device=args.device, repeats=args.lce_repeats)
    base = results["model(**batch, labels) as shipped"]
    fp32_copy_mib = b * t * v * 4 / 2**20
    rows = []
    for name, m in results.items():
        drop = None if m.peak_extra_bytes is None or base.peak_extra_bytes is None else \
            (base.peak_extra_bytes - m.peak_extra_bytes) / 2**20
        rows.append([name, m.ms, ratio(m.seconds, base.seconds), m.peak_mib, drop,
                     None if drop is None else drop / fp32_copy_mib, m.error or "ok"])
    table = Table(
        title=f"Hugging Face loss step, tiny Llama (H=64, 2 layers) {args.lce_dtype}, batch {b}x{t}, V={v}, "
              f"on {args.device}",
        columns=["variant", "time (ms)", "x shipped", "peak extra (MiB)", "drop (MiB)", "drop / fp32 logits",
                 "status"],
        rows=rows,
        baseline=f"model(**batch, labels=...).loss.backward() with Transformers' ForCausalLMLoss; "
                 f"one fp32 copy of the logits is {fp32_copy_mib:.0f} MiB",
        notes=["loss and gradients of the three variants are asserted equal in tests/model_patches/loss/test_loss_record.py "
               "and tests/model_patches/loss/test_causal_lm_loss.py",
               f"dtype {args.lce_dtype}: {args.lce_dtype_reason}"],
        command="python -m bench --only lce " + " ".join(shlex.quote(a) for a in [
            "--lce-hf", args.lce_hf, "--lce-dtype", args.lce_dtype, "--lce-repeats", str(args.lce_repeats),
            "--device", args.device]),
        spread=spreads(results),
    )
    return table, {"hf_shape": [b, t, v], "hf_results": {k: vars(m) for k, m in results.items()}}
