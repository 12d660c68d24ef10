"""The ``train`` section's planned longest context: :func:`ac_policies.longest_context` at the published
depth, checked by measured steps, and a projection for GPU-sized models.

1. :func:`planned_context_table`: for a model at full depth (Qwen3-0.6B's 28 layers by default),
   the longest context whose step fits the same budget above the static state (parameters,
   gradients, AdamW state), estimated on fake tensors for stock with Hugging Face checkpointing and
   for the library (the ``long_context`` policy and the hidden-state loss). Each answer is checked
   by real steps (:func:`ac_policies.estimate.measure_step`, the estimate's ground truth: every
   tensor alive, the loss operators' chunk workspace included) at the answer and at the length the
   search reported as too long, each in its own process, with the estimate's error beside them.
2. :func:`projection_table`: Llama-3.1-8B and Qwen3-30B-A3B on one 80 GiB device and on 8 with FSDP2,
   stock with Hugging Face checkpointing against the library, estimated only (CUDA allocator
   rounding, checkpoint offload modelled, parameters in host memory on one device as ALST places
   them). It says "estimated, not measured" until ``bench/gpu_check.sh``'s CUDA step has run it.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional

import torch

from bench.harness import isolated
from bench.harness.report import Table, ratio
from bench.sections.train.models import model_entry
from bench.sections.train.peer_tiling import PEER, apply_deepspeed_tiling, deepspeed_tiling_available

MIB = 2**20
GIB = 2**30
#: The full-depth search's budget above the static state, and its first length.
PLANNED_BUDGET_ABOVE_STATIC = 2 * GIB
#: Lengths the library's estimate is checked at by measured steps (its answer, past 10K tokens at
#: Qwen3-0.6B's 28 layers, takes longer than a quarter of an hour per measured step on 2 CPU cores).
LIBRARY_CHECKS = (2048, 4096)
START = 256
TARGET_RATIO = 8.0
PROJECTED = ("llama3.1-8b", "qwen3-30b-a3b")
#: Where the projection puts the step: (devices, FSDP2 processes, placement): "host" is FSDP2's
#: CPUOffloadPolicy for the library and the peer, "device" bf16 parameters and gradients on the device with
#: AdamW in host memory (Llama-3.1-8B only: Qwen3-30B-A3B's bf16 weights and gradients alone pass 80 GiB),
#: None everything on the device, sharded; "context parallel" that, and the sequence sharded over the
#: same processes.
PROJECTION_CASES = (("1 x 80 GiB", 1, "host"), ("1 x 80 GiB", 1, "device"), ("8 x 80 GiB, FSDP2", 8, None),
                    ("8 x 80 GiB, FSDP2 x CP 8", 8, "context parallel"))
#: Processes the sequence is sharded over in the "context parallel" placement (the library's plan only:
#: packed documents under CP are ``model_patches.enable_context_parallel``'s).
CONTEXT_PARALLEL = 8
#: Trainer's default optimizer (``adamw_torch_fused``): no parameter-sized temporaries in its step.
OPTIMIZER = "adamw_fused"

PLANS = {
    "stock+hf_gc": "Transformers' loss, Hugging Face gradient checkpointing",
    "library": "apply_policy('long_context') + enable_linear_cross_entropy",
    PEER: "DeepSpeed's TiledMLP on every MLP (ceil(tokens / hidden) shards) + TiledFusedLogitsLoss (1 GiB fp32 "
          "logits per shard) + Hugging Face gradient checkpointing: ALST's single-device pieces",
}


def plans() -> list[str]:
    """The plans this machine can run: the peer's needs DeepSpeed (``pip install '.[engines]'``)."""
    return [p for p in PLANS if p != PEER or deepspeed_tiling_available()]


def _model(name: str, layers: Optional[int], dtype: torch.dtype, meta: bool, seed: int = 0) -> torch.nn.Module:
    import transformers

    entry = model_entry(name)
    values = {**entry.config, "use_cache": False}
    if layers:
        values["num_hidden_layers"] = layers
    config = transformers.AutoConfig.for_model(entry.model_type, **values)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=entry.attention, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=entry.attention, dtype=dtype)
    return model.train()


def _prepared(name: str, plan: str, layers: Optional[int], dtype: torch.dtype, meta: bool) -> torch.nn.Module:
    import ac_policies
    import model_patches

    model = _model(name, layers, dtype, meta)
    if plan == "stock+hf_gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif plan == PEER:
        apply_deepspeed_tiling(model)
    else:
        model_patches.enable_linear_cross_entropy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
            ac_policies.apply_policy(model, "long_context")
    return model


def _static(e: Any) -> int:
    return e.params + e.buffers + e.grads + e.optimizer


def search_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One plan's search on the meta model: the static bytes, the answer and the first length too long."""
    import ac_policies
    from ac_policies.estimate import token_step

    dtype = getattr(torch, spec["dtype"])
    model = _prepared(spec["model"], spec["plan"], spec["layers"], dtype, meta=True)
    vocab = model.config.vocab_size
    kwargs = dict(device=spec["device"], world_size=spec.get("world_size", 1),
                  offload_params=spec.get("offload_params", False), optimizer=spec.get("optimizer", OPTIMIZER),
                  context_parallel=spec.get("context_parallel", 1))
    static = _static(ac_policies.estimate(model, token_step(vocab)(START), **kwargs))
    budget = spec.get("budget") or static + spec["above_static"]
    start = time.perf_counter()
    found = ac_policies.longest_context(model, token_step(vocab), budget, start=START, recommend=False,
                                        max_tokens=spec.get("max_tokens", 1 << 21), **kwargs)
    row = found.rows[0]
    return {"static": static, "budget": budget, "tokens": row.tokens, "too_long": row.too_long,
            "peak": row.fits.peak if row.fits else None, "over_peak": row.over.peak if row.over else None,
            "too_long_predicted": row.too_long_predicted, "limit": row.limit, "seconds": time.perf_counter() - start}


def measure_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One real step of a plan at ``spec["tokens"]`` (real weights): the measured peak and the estimate."""
    import ac_policies
    from ac_policies.estimate import measure_step, token_step

    dtype = getattr(torch, spec["dtype"])
    model = _prepared(spec["model"], spec["plan"], spec["layers"], dtype, meta=False)
    step = token_step(model.config.vocab_size)(spec["tokens"])
    start = time.perf_counter()
    real = measure_step(model, step, optimizer=OPTIMIZER)
    seconds = time.perf_counter() - start
    est = ac_policies.estimate(model, step, optimizer=OPTIMIZER)
    return {"measured": real.peak, "estimated": est.peak, "static": _static(real), "seconds": seconds,
            "phase": real.peak_phase, "module": real.peak_module}


def planned_context_table(model: str, layers: Optional[int], dtype: str, command: str, timeout: float,
                          tick: Callable[[str], None], above_static: int = PLANNED_BUDGET_ABOVE_STATIC,
                          check_lengths: tuple[int, ...] = LIBRARY_CHECKS) -> tuple[Table, dict[str, Any]]:
    """:func:`ac_policies.longest_context` for stock+hf_gc and the library at ``layers`` (None: the
    published depth), checked by measured steps: stock's answer and its too-long length, the
    library's estimate at ``check_lengths``."""
    found: dict[str, Any] = {}
    rows = []
    for plan in plans():
        tick(f"train planned context {model} {plan}")
        spec = {"model": model, "plan": plan, "layers": layers, "dtype": dtype, "device": None,
                "above_static": above_static}
        s = isolated.call(search_worker, spec, timeout=timeout)
        lengths = [("fits", s["tokens"]), ("too long", s["too_long"])]
        checked = lengths if plan == "stock+hf_gc" else [("check", t) for t in check_lengths]
        checks = {}
        for label, tokens in checked:
            if tokens:
                tick(f"train planned context {model} {plan} {tokens}")
                checks[(label, tokens)] = isolated.call(measure_worker, {**spec, "tokens": tokens}, timeout=timeout)
        found[plan] = {"search": s, "checks": {f"{k[0]} {k[1]}": v for k, v in checks.items()}}
        for label, tokens in dict.fromkeys(lengths + checked):
            m = checks.get((label, tokens))
            est = {"fits": s["peak"], "too long": s["over_peak"]}.get(label, m and m["estimated"])
            rows.append([
                plan, label, tokens, None if est is None else (est - s["static"]) / MIB,
                None if m is None else (m["measured"] - m["static"]) / MIB,
                None if m is None or est is None else f"{(est - m['measured']) / m['measured']:+.1%}",
                None if m is None else ("yes" if m["measured"] <= s["budget"] else "no"),
                None if m is None else round(m["seconds"], 1),
                s["limit"] if label == "too long" else (f"search {s['seconds']:.0f} s" if label == "fits" else ""),
            ])
    tokens = {p: found[p]["search"]["tokens"] for p in found}
    got = ratio(tokens["library"], tokens["stock+hf_gc"])
    peer = (f"{PEER} / stock: {ratio(tokens[PEER], tokens['stock+hf_gc']):.2f}x; library / {PEER}: "
            f"{ratio(tokens['library'], tokens[PEER]):.2f}x (target >= 1)" if tokens.get(PEER) and tokens["stock+hf_gc"]
            else f"{PEER}: " + ("no answer" if PEER in found else "not run: DeepSpeed is not installed (pip install "
                                                                "'.[engines]')"))
    notes = [
        f"{model} at {'its published depth' if not layers else f'{layers} layers'} ({dtype}, sdpa, random "
        "weights), one row of the given length, fused AdamW (Trainer's default); budget: the static state (parameters, gradients, AdamW "
        f"state) + {above_static / MIB:.0f} MiB, the same for every plan",
        "estimated: ac_policies.longest_context on the meta model (fake tensors, every length traced or "
        "extrapolated from two shallow copies of the model); measured: one real step in its own process, every "
        "tensor alive counted (ac_policies.estimate.measure_step), the loss operators' chunk workspace included",
        f"library / stock longest context: {'-' if got is None else f'{got:.2f}'}x (target >= {TARGET_RATIO:g}x)",
        "checked: stock's answer and its too-long length by measured steps; the library's and the peer's estimates at "
        f"{', '.join(map(str, check_lengths))} tokens (a measured step at its answer's length takes longer than a "
        "quarter of an hour on 2 CPU cores under the live-tensor accounting; the answer-fits and next-does-not "
        "property is tested on small models in tests/ac_policies/estimate/test_longest_context.py)",
        peer,
        *(f"{p}: {d}" for p, d in PLANS.items() if p in found),
    ]
    table = Table(title=f"train: {model}, longest context planned before launch, checked by measured steps",
                  columns=["plan", "length", "tokens", "estimated peak above static (MiB)",
                           "measured peak above static (MiB)", "estimate error", "fits the budget (measured)",
                           "measured step (s)", "what limits it / search time"],
                  rows=rows, command=command, baseline="stock+hf_gc", notes=notes)
    return table, found


def projection_searches() -> list[tuple[str, str, int, Optional[str], str]]:
    """``(model, devices, FSDP2 processes, placement, plan)`` of each projected search."""
    return [(model, where, world, placement, plan)
            for model in PROJECTED for where, world, placement in PROJECTION_CASES for plan in plans()
            # stock keeps everything on the device in the first case already; 30B's weights pass 80 GiB
            if placement != "device" or (plan != "stock+hf_gc" and model == "llama3.1-8b")
            if placement != "context parallel" or plan == "library"]


def projection_table(command: str, timeout: float, tick: Callable[[str], None], measured: bool = False
                     ) -> tuple[Table, dict[str, Any]]:
    """Llama-3.1-8B and Qwen3-30B-A3B (bf16) on one 80 GiB device (parameters, gradients and optimizer
    state in host memory for the library, as ALST places them) and on 8 with FSDP2, estimated."""
    rows, found = [], {}
    for model, where, world, placement, plan in projection_searches():
        tick(f"train projection {model} {where} {placement} {plan}")
        library = plan == "library"
        on_host = placement == "host" and plan != "stock+hf_gc"
        spec = {"model": model, "plan": plan, "layers": None, "dtype": "bfloat16", "device": "cuda",
                "budget": 80 * GIB, "world_size": world, "offload_params": on_host,
                "optimizer": None if placement == "device" else "adamw", "max_tokens": 1 << 22,
                "context_parallel": CONTEXT_PARALLEL if placement == "context parallel" else 1}
        try:
            s = isolated.call(search_worker, spec, timeout=timeout)
        except isolated.WorkerFailed as exc:  # one failed search (or a timeout) leaves the others' rows
            s = {"tokens": None, "too_long": None, "limit": f"error: {exc}"}
        found[(model, where, placement, plan)] = s
        place = ("parameters, gradients, AdamW in host memory" if on_host else
                 "bf16 parameters and gradients on the device, AdamW in host memory" if placement == "device"
                 else f"all on the device; the sequence sharded over the {world} (enable_context_parallel)"
                 if placement == "context parallel" else "all on the device")
        place += "; checkpoints offloaded" if library else ""
        rows.append([model, where, plan, place, s["tokens"], s["too_long"] or "-",
                     "predicted" if s.get("too_long_predicted") else "traced", s["limit"]])
    notes = ["estimated, not measured" if not measured else "measured on CUDA by bench/gpu_check.sh",
             "ac_policies.longest_context with device='cuda' (512-byte allocator rounding; fragmentation, the CUDA "
             "context and library workspaces not counted), AdamW (foreach), one row, sdpa",
             "stock+hf_gc keeps everything on the device; the library uses long_context (on CUDA, block inputs in host "
             "memory) and the hidden-state loss; on one device the library and the peer have FSDP2's CPUOffloadPolicy "
             "(one block's bf16 parameters gathered at a time), which is ALST's single-device placement, or bf16 "
             "parameters and gradients on the device with the AdamW step in host memory (no optimizer on the device)",
             f"{PEER}: DeepSpeed's pieces with Hugging Face checkpointing; ALST's checkpoint offload is not modelled, "
             "so its checkpoints stay on the device"]
    table = Table(title="train: longest context projected for GPU-sized models (estimated, not measured)",
                  columns=["model", "devices", "plan", "placement", "longest context", "too long", "too long is",
                           "what limits it"],
                  rows=rows, command=command, baseline="stock+hf_gc", notes=notes)
    return table, {f"{m}|{w}|{c}|{p}": v for (m, w, c, p), v in found.items()}
