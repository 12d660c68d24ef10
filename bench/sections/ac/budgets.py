"""``ac`` section, memory budgets: ``ac_policies.fit`` next to the presets and to ``torch.compile``'s
``activation_memory_budget``, at 0.5 / 0.7 / 0.9 of the step peak without checkpointing (the quick
run: 0.7 alone).

One table per model (a dense Llama and the section's Qwen3-MoE, both hidden 256, batch 2). Every
row is one training step (forward and backward of the causal-LM loss), measured after a warm-up
step:

- eager rows (no checkpointing, the presets, ``fit(b)``): ``ac_policies.measure.step_cost``: the
  step peak (most activation bytes alive at any op boundary over forward plus backward;
  parameters and their gradients excluded) and the recompute FLOPs (ops run with grad mode on
  during backward). ``fit(b)`` is called on the model, then the policy it returns is applied and
  measured like a preset.
- ``torch.compile`` rows: the model compiled whole (``fullgraph=True``) with the backend
  ``aot_eager_decomp_partition_with_mode``: Inductor's decompositions and its min-cut partitioner
  (the one that honours ``torch._functorch.config.activation_memory_budget``), the partitioned
  forward and backward graphs run op by op in eager, inside a dispatch mode that the backend
  enters around each graph. A dispatch mode entered *around* a compiled call does not measure it:
  Dynamo then skips the frame and the model runs eagerly (checked on torch 2.13); so the mode the
  backend enters relays each op to the step's live-bytes counter (the one ``step_bytes`` uses).
  Everything the step allocates runs inside the two graphs except autograd's scalar seed of
  backward. Recompute = FLOPs of the compiled backward graph (``ac_policies.measure.flop_counter``
  around ``backward()``) minus those of the same model compiled at budget 1.0.
"""

from __future__ import annotations

import argparse
import functools
import gc
import re
import shlex
import warnings
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ac_policies
from ac_policies.accounting import LiveBytes, measured_device, storage_key
from ac_policies.measure import flop_counter, step_cost
from bench.harness.modes import override, pick
from bench.harness.report import Table, ratio
from bench.sections.ac.model import build, model_config

#: Budgets as fractions of the step peak without checkpointing: --full, and the quick run's.
FULL_BUDGETS = (0.5, 0.7, 0.9)
QUICK_BUDGETS = (0.7,)
BATCH = 2
MIB = 2**20
#: Presets measured per model kind (``non_moe`` needs a MoE block).
PRESETS = {"dense": ("full", "selective"), "moe": ("full", "selective", "non_moe")}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ac-budgets", choices=["on", "off"], default="on",
                       help="the tables of fit() and torch.compile's activation_memory_budget at --ac-budgets-at "
                            "of the peak without checkpointing (default on)")
    group.add_argument("--ac-budgets-at", type=lambda s: tuple(float(x) for x in s.split(",")), metavar="B,B",
                       help="the budgets, as fractions of that peak (default 0.7; --full 0.5,0.7,0.9)")
    group.add_argument("--ac-budgets-seq", type=int,
                       help=f"sequence length of those tables (batch {BATCH}; default 64, --full 256)")
    group.add_argument("--ac-budgets-layers", type=int,
                       help="decoder layers of their dense and MoE models (default 2, --full 4)")


def resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quick or full defaults of the budget tables' flags the user left unset."""
    return override(args, ac_budgets=getattr(args, "ac_budgets", None) or "on",
                    ac_budgets_at=pick(args, getattr(args, "ac_budgets_at", None), QUICK_BUDGETS, FULL_BUDGETS),
                    ac_budgets_seq=pick(args, getattr(args, "ac_budgets_seq", None), 64, 256),
                    ac_budgets_layers=pick(args, getattr(args, "ac_budgets_layers", None), 2, 4))


def count(args: argparse.Namespace) -> int:
    """Progress steps: per model, each eager row and each compiled one (budget 1.0 included)."""
    args = resolved(args)
    if args.ac_budgets == "off":
        return 0
    return sum(1 + len(presets) + 2 * len(args.ac_budgets_at) + 1 for presets in PRESETS.values())


def llama_config(seq: int, layers: int) -> dict[str, Any]:
    """A small dense Llama: hidden 256 (as the section's MoE model), 8 query heads x 32, 4 KV heads,
    MLP intermediate 768, vocabulary 1024, fp32."""
    return dict(hidden_size=256, intermediate_size=768, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=1024, max_position_embeddings=seq, use_cache=False)


def build_llama(cfg: dict[str, Any], device: str) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model("llama", **cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().to(device).train()


def _fallback_formulas() -> dict:
    """FLOP formulas for Transformers' ``grouped_mm_fallback`` custom ops: under ``torch.compile``
    in fp32 its MoE experts run them instead of ``aten._grouped_mm``, and torch's counter has none.
    Every row of the (sorted) input meets one expert: 2 x rows x in x out, twice that for backward."""
    ops = getattr(torch.ops, "transformers", None)
    if ops is None or not hasattr(ops, "grouped_mm_fallback"):
        return {}

    def forward(x_shape, w_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
        return 2 * x_shape[0] * w_shape[1] * w_shape[2]

    def backward(x_shape, w_shape, *args: Any, out_shape=None, **kwargs: Any) -> int:
        return 4 * x_shape[0] * w_shape[1] * w_shape[2]

    return {ops.grouped_mm_fallback: forward, ops.grouped_mm_fallback_backward: backward}


class _Relay(TorchDispatchMode):
    """The mode the compiled graphs run in: each op goes to ``target`` (a dispatch mode's
    ``__torch_dispatch__``, here the step's live-bytes counter) while one is set, else just runs."""

    def __init__(self) -> None:
        super().__init__()
        self.target: Optional[TorchDispatchMode] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.target is None:
            return func(*args, **(kwargs or {}))
        return self.target.__torch_dispatch__(func, types, args, kwargs)


class _Timeline(LiveBytes):
    """:class:`LiveBytes` that also keeps the bytes alive after each op and, per storage, the ops it
    was alive across, so that the peak can be taken without some storages afterwards."""

    def __init__(self, owned: set, device_type: Optional[str] = None) -> None:
        super().__init__(owned, device_type)
        self.totals: list[int] = []
        self.spans: dict[int, list[Any]] = {}  # storage key -> [first op, last op, bytes, weak ref] of its current life
        self.excluded: list[list[int]] = []  # spans left out of :meth:`peak_without`

    def total(self) -> int:
        n = super().total()
        i = len(self.totals)
        for key, (ref, size) in self.refs.items():
            span = self.spans.get(key)
            if span is None or span[3] is not ref:  # a new storage at a reused address
                self.spans[key] = span = [i, i, size, ref]
            span[1] = i
        self.totals.append(n)
        return n

    def exclude(self, tensor: torch.Tensor) -> None:
        """Leave ``tensor``'s storage (alive now) out of :meth:`peak_without`."""
        span = self.spans.get(storage_key(tensor))
        if span is not None and all(span is not s for s in self.excluded):
            self.excluded.append(span)

    def peak_without(self) -> int:
        """The peak with the excluded storages' bytes taken off every op they were alive across."""
        diff = [0] * (len(self.totals) + 1)
        for first, last, size, _ in self.excluded:
            diff[first] += size
            diff[last + 1] -= size
        out, running = 0, 0
        for i, total in enumerate(self.totals):
            running += diff[i]
            out = max(out, total - running)
        return out


def compiled_step(model: torch.nn.Module, step: Callable[[torch.nn.Module], torch.Tensor],
                  budget: float) -> dict[str, int]:
    """Step peak and backward FLOPs of ``step(compiled model)``, compiled under
    ``activation_memory_budget=budget``: one warm-up step (compile and partition), then the
    measured one.

    Parameters and their accumulated gradients are excluded, as ``step_bytes`` does; so are the
    parameter gradients the backward graph returns (``peak``): the whole model's backward is one
    graph, so they are all alive at its end, where eager's backward frees each one as it is
    accumulated. ``peak_with_grads`` counts them."""
    from torch._dynamo.backends.debugging import aot_eager_decomp_partition_with_mode

    torch._dynamo.reset()
    relay = _Relay()
    backend = functools.partial(aot_eager_decomp_partition_with_mode, mode=relay)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    hooks = []
    try:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            step(compiled).backward()
            params = [*model.parameters(), *model.buffers()]
            owned = {storage_key(t) for t in params}
            owned |= {storage_key(p.grad) for p in model.parameters() if p.grad is not None}
            live = _Timeline(owned, measured_device(model))
            counter = flop_counter(custom_mapping=_fallback_formulas())
            hooks = [p.register_hook(lambda g: live.exclude(g)) for p in model.parameters() if p.requires_grad]
            relay.target = live
            try:
                loss = step(compiled)
                gc.collect()
                with counter:
                    loss.backward()
                del loss
            finally:
                relay.target = None
    finally:
        for h in hooks:
            h.remove()
        torch._dynamo.reset()
    return {"peak": live.peak_without(), "peak_with_grads": live.peak, "backward_flops": counter.get_total_flops()}


def _eager_backward_flops(model: torch.nn.Module, step: Callable[[torch.nn.Module], torch.Tensor]) -> int:
    loss = step(model)
    with flop_counter() as counter:
        loss.backward()
    return counter.get_total_flops()


def _policy_cost(model: torch.nn.Module, step: Callable[[torch.nn.Module], torch.Tensor], policy: Any) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)  # `full` warns about MoE recompute
        handle = ac_policies.apply_policy(model, policy)
    try:
        cost = step_cost(model, lambda: step(model))
    finally:
        handle.remove()
    return {"peak": cost.peak, "flops": cost.recompute_flops}


def measure_model(model: torch.nn.Module, ids: torch.Tensor, presets: tuple[str, ...], budgets: tuple[float, ...],
                  tick: Callable[[str], None], label: str) -> dict[str, dict[str, Any]]:
    """Every row of one model's table, as figures: ``peak`` (bytes), ``flops`` (recomputed),
    ``budget`` (bytes, budget rows), ``rules`` (fit rows), ``status``."""

    def step(m: torch.nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    tick(f"ac budgets {label}: none")
    _policy_cost(model, step, "none")  # warm-up
    rows: dict[str, dict[str, Any]] = {"none": {**_policy_cost(model, step, "none"), "status": "ok"}}
    peak0 = rows["none"]["peak"]
    rows["none"]["backward_flops"] = _eager_backward_flops(model, step)
    for preset in presets:
        tick(f"ac budgets {label}: {preset}")
        rows[preset] = {**_policy_cost(model, step, preset), "status": "ok"}
    for b in budgets:
        tick(f"ac budgets {label}: fit({b})")
        limit = int(b * peak0)  # as fit() reads a fractional budget
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ac_policies.ACPolicyWarning)
                policy = ac_policies.fit(model, lambda: step(model), b)
        except ValueError as err:
            lowest = re.search(r"choices reach: ([0-9.]+ MiB)", str(err))
            rows[f"fit({b})"] = {"peak": None, "flops": None, "budget": limit, "rules": None, "error": str(err),
                                 "status": f"refused: lowest peak {lowest.group(1)}" if lowest else "refused"}
        else:
            rows[f"fit({b})"] = {**_policy_cost(model, step, policy), "budget": limit, "rules": len(policy.rules),
                                 "table": policy.to_dicts(), "status": "ok"}
    compiled: dict[float, dict[str, Any]] = {}
    for b in (1.0, *budgets):
        tick(f"ac budgets {label}: torch.compile budget {b}")
        try:
            compiled[b] = {**compiled_step(model, step, b), "status": "ok"}
        except Exception as err:  # noqa: BLE001 - a graph break or a backend error: the row says which
            compiled[b] = {"peak": None, "backward_flops": None, "status": f"error: {type(err).__name__}: {err}"[:200]}
    base_flops = compiled[1.0]["backward_flops"]
    for b, r in compiled.items():
        flops = None if r["backward_flops"] is None or base_flops is None else r["backward_flops"] - base_flops
        rows[f"torch.compile budget={b}"] = {**r, "flops": flops, "budget": int(b * peak0) if b < 1.0 else None}
    return rows


def _table_rows(rows: dict[str, dict[str, Any]]) -> list[list[Any]]:
    peak0, full = rows["none"]["peak"], rows["full"]["flops"]
    out = []
    for name, r in rows.items():
        peak, budget = r["peak"], r.get("budget")
        within = None if budget is None else ("yes" if peak is not None and peak <= budget else "no")
        out.append([name, None if peak is None else peak / MIB, ratio(peak, peak0),
                    None if budget is None else budget / MIB, within,
                    None if r["flops"] is None else r["flops"] / 1e9, ratio(r["flops"], full),
                    r.get("rules"), r["status"]])
    return out


def _command(args: argparse.Namespace) -> str:
    opts = ["--ac-budgets-at", ",".join(map(str, args.ac_budgets_at)), "--ac-budgets-seq", str(args.ac_budgets_seq),
            "--ac-budgets-layers", str(args.ac_budgets_layers), "--device", args.device]
    return "python -m bench --only ac " + " ".join(shlex.quote(a) for a in opts)


def _notes(desc: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    base = rows["torch.compile budget=1.0"].get("backward_flops")
    eager = rows["none"]["backward_flops"]
    with_grads = " / ".join(f"{name.split('=')[1]}: {_mib(r.get('peak_with_grads'))}"
                            for name, r in rows.items() if name.startswith("torch.compile"))
    return [
        f"model: {desc}; batch {BATCH}, random tokens, random init, fp32, sdpa attention",
        "step peak = the most activation bytes alive at once over forward plus backward (ac_policies.measure "
        "step_bytes: recompute, activation gradients and backward temporaries included; parameters and their "
        "gradients excluded), after one warm-up step; x none = of the eager step without checkpointing",
        "budget b = int(b x none's step peak), as fit() reads a fraction; within = step peak <= budget; "
        "refused = fit() raised: the budget is below the lowest peak its choices reach (named)",
        "eager rows: recompute = FLOPs of ops run with grad mode on during backward (step_cost); fit(b) = "
        "ac_policies.fit(model, step, b), then its policy measured like a preset; rules = rows of its table",
        "torch.compile rows: fullgraph, backend aot_eager_decomp_partition_with_mode (Inductor's decompositions "
        "and min-cut partitioner, graphs run op by op in eager inside a dispatch mode that counts their bytes; "
        "a mode entered around a compiled call makes Dynamo run the model eagerly instead); budget b = "
        "torch._functorch.config.activation_memory_budget, a fraction of the compiled step's own saved "
        "activations, not of the peak; no Inductor fusion or buffer reuse, so an Inductor build peaks lower",
        "torch.compile recompute = FLOPs of the compiled backward graph minus those at budget 1.0 (the default "
        f"partitioner, which recomputes only ops without FLOPs); compiled backward at 1.0: "
        f"{_gflop(base)} GFLOP, eager backward without checkpointing: {_gflop(eager)} GFLOP",
        "torch.compile step peak leaves out the parameter gradients its backward graph returns (all alive at "
        "the graph's end; eager frees each as it is accumulated, and step_bytes excludes parameter gradients); "
        f"counting them, the compiled peaks are {with_grads} MiB",
        "x full = recompute FLOPs over the full preset's (every decoder block recomputed)",
    ]


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / MIB:.3g}"


def _gflop(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 1e9:.3g}"


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> tuple[list[Table], dict[str, Any]]:
    """The budget tables (none with ``--ac-budgets off``) and their figures for ``--json``."""
    args = resolved(args)
    if args.ac_budgets == "off":
        return [], {}
    seq, layers = args.ac_budgets_seq, args.ac_budgets_layers
    models = {  # kind -> (name, description, constructor)
        "dense": ("dense Llama", f"Llama, {layers} layers, hidden 256, 8x32 query heads, 4 KV heads, MLP 768, vocab 1024",
                  lambda: build_llama(llama_config(seq, layers), args.device)),
        "moe": ("Qwen3-MoE", f"Qwen3-MoE as above, {layers} layers, hidden 256, 8x64 query heads, 4 KV heads, 8 experts top-2 "
                "(intermediate 128), vocab 1024", lambda: build(model_config(seq, layers), args.device)),
    }
    ids = torch.randint(2, 1024, (BATCH, seq), generator=torch.Generator().manual_seed(0)).to(args.device)
    tables, data = [], {"seq": seq, "layers": layers, "batch": BATCH, "budgets": list(args.ac_budgets_at),
                      "models": {}}
    for kind, (name, desc, make) in models.items():
        rows = measure_model(make(), ids, PRESETS[kind], args.ac_budgets_at, tick, kind)
        data["models"][kind] = rows
        tables.append(Table(
            title=f"fit() and torch.compile activation_memory_budget at {'/'.join(map(str, args.ac_budgets_at))} of the peak: "
                  f"{name} ({layers} layers, {BATCH} x {seq} tokens, {args.device})",
            columns=["row", "step peak (MiB)", "x none", "budget (MiB)", "within budget", "recompute (GFLOP)",
                     "x full", "fit rules", "status"],
            rows=_table_rows(rows),
            baseline="none: the same model in eager without checkpointing, same run",
            notes=_notes(desc, rows),
            command=_command(args),
        ))
    return tables, data
