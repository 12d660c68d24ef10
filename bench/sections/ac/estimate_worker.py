"""One case of the estimate accuracy table (:mod:`bench.sections.ac.estimate`), in a fresh process.

:func:`bench.sections.ac.estimate.run_case` runs :func:`run` in a fresh process (:mod:`bench.harness.isolated`);
``python -m bench.sections.ac.estimate_worker '<json spec>'`` runs one by hand and prints the result as JSON. The spec: ``family``, ``policy`` (a preset, ``"none"`` or ``"fit"``), ``hidden_state``
(the hidden-state loss), ``seq``, ``sizes`` (config values for every family). In order:

1. ``ac_policies.estimate`` on fake tensors (``fit(..., FIT_BUDGET, fake=True)`` first for ``"fit"``);
2. the resident set of a plain step (no dispatch mode): the optimizer (the estimate's own AdamW,
   foreach) is built, one warm-up step runs (optimizer state, first-call effects), gradients are
   set to None; the baseline is the resident set then (``VmHWM`` right after its reset through
   ``/proc/self/clear_refs``), the peak is ``VmHWM`` over one more step (forward, backward,
   optimizer step); ``rss_extra`` = peak - baseline;
3. ``measure_step``: the estimate's live-tensor accounting on a real step.

Each case gets its own process so that nothing an earlier case freed, cached or fragmented sits
in the baseline. The resident set follows live bytes only when freed blocks go back to the
kernel: torch's CPU allocator (``c10::alloc_cpu``) calls ``posix_memalign``, and glibc serves a
block by ``mmap`` (returned at ``free``) from ``MALLOC_MMAP_THRESHOLD_`` up, which
:mod:`bench.harness.isolated` sets to 64 KiB (the default, 128 KiB, grows with every freed mapping, after
which freed activations stay in the heap).
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import time
import warnings
from typing import Any, Callable

import torch

from bench.harness.rss import reset_peak_rss, rss_bytes

#: The budget of the ``"fit"`` cases: a fraction of the step peak without checkpointing.
FIT_BUDGET = 0.95

#: Per family, on top of ``sizes``: MoE with 4 experts, top-2; Qwen3-Next alternates a
#: gated-delta-net layer and an attention layer (``layer_types`` follows ``num_hidden_layers``).
FAMILY_SIZES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                       linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                       linear_conv_kernel_dim=4),
}


def build(family: str, sizes: dict[str, Any]) -> torch.nn.Module:
    from model_patches.testing import tiny_causal_lm

    n = sizes["num_hidden_layers"]
    extra = {"layer_types": (["linear_attention", "full_attention"] * n)[:n]} if family == "qwen3_next" else {}
    return tiny_causal_lm(family, None, 0, sizes=sizes, family_sizes=FAMILY_SIZES, train=True,
                          max_parameters=10**9, **extra).float()


def make_step(vocab: int, seq: int) -> Callable[[torch.nn.Module], torch.Tensor]:
    """``step(model) -> loss`` on one seeded row of ``seq`` tokens, on the model's device (random
    ones under fake tensors, whose copies of the weights are on the CPU)."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))

    def step(m: torch.nn.Module) -> torch.Tensor:
        weight = m.get_input_embeddings().weight
        x = torch.randint(0, vocab, (1, seq)) if isinstance(weight, torch._subclasses.FakeTensor) else ids
        x = x.to(weight.device)
        return m(input_ids=x, labels=x).loss

    return step


def plain_step(model: torch.nn.Module, step: Callable) -> Callable[[], None]:
    """One training step of ``model`` as users run it (``step(model)``'s loss, its backward, an AdamW
    step), with no dispatch mode around it; the optimizer is made once, here."""
    from ac_policies.estimate.trace import make_optimizer

    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], "adamw")

    def one() -> None:
        loss = step(model)
        loss.backward()
        del loss
        opt.step()

    return one


def rss_step(model: torch.nn.Module, step: Callable) -> dict[str, int]:
    """Resident-set peak of one plain step above the resident set after a warm-up step (see the
    module's docs); also the baseline and what is resident after the step, less the baseline."""
    one = plain_step(model, step)
    one()
    model.zero_grad(set_to_none=True)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset_peak_rss()
    base = rss_bytes("VmHWM")  # right after the reset: the resident set now
    one()
    peak = rss_bytes("VmHWM") - base
    after = rss_bytes("VmRSS") - base
    model.zero_grad(set_to_none=True)
    return {"rss_baseline": base, "rss_extra": peak, "rss_after": after}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import ac_policies
    import model_patches
    from ac_policies.estimate import measure_step

    clock = time.perf_counter()
    model = build(spec["family"], spec["sizes"])
    step = make_step(model.config.vocab_size, spec["seq"])
    if spec["hidden_state"]:
        model_patches.enable_linear_cross_entropy(model)
    policy = spec["policy"]
    table = ac_policies.fit(model, step, FIT_BUDGET, fake=True) if policy == "fit" else policy
    if table != "none":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            ac_policies.apply_policy(model, table)
    est = ac_policies.estimate(model, step)
    seconds = {"estimate": time.perf_counter() - clock}
    clock = time.perf_counter()
    rss = rss_step(model, step)
    seconds["rss"], clock = time.perf_counter() - clock, time.perf_counter()
    real = measure_step(model, step)
    seconds["measured"] = time.perf_counter() - clock
    held = est.params + est.buffers + est.optimizer
    return {**spec, "estimated_peak": est.peak, "measured_peak": real.peak, "workspace": est.workspace,
            "estimated_step_extra": est.peak - held,
            "measured_step_extra": real.peak - held, "held": held, "grads": est.grads,
            "peak_phase": est.peak_phase, "peak_module": est.peak_module,
            "seconds": seconds, **rss}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
