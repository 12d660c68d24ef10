"""``dist`` section: the vocabulary-parallel losses over 2 and 4 processes, per rank.

The section spawns the processes itself (gloo on CPU, one process per GPU with nccl on CUDA;
a world larger than the GPU count is reported as skipped) and reports, per rank (the largest
over ranks), the step time, the peak extra memory and the bytes handed to collectives in
forward and in backward.

Logits form, ``[N, V]`` logits sharded over the vocabulary (``Shard(-1)``):
  - ``loss_parallel + F.cross_entropy``: torch's ``loss_parallel()`` on ``logits.float()``,
    the baseline;
  - ``full_tensor + functional_ce``: gather the logits, then the single-process function;
  - ``functional_ce``: :func:`functional_ce.cross_entropy` on the DTensor; and ``inplace``.
Hidden-state form, ``hidden [N, H]`` on every rank and a column-parallel LM head ``[V, H]``:
  - ``ColwiseParallel lm_head + loss_parallel``: the baseline;
  - ``functional_ce.linear_cross_entropy`` on the DTensor weight.
FSDP2, a 2-layer Llama with ``fully_shard`` on each decoder layer and the root, each rank on its
own batch:
  - ``model(**batch).loss``: the model's own loss, the baseline;
  - ``model_patches.causal_lm_loss``: the hidden-state loss inside the root's FSDP2 call.
Pipeline, 2 stages (GPipe, 4 microbatches), the last stage's ``loss_fn``:
  - ``F.cross_entropy(logits.float())``: the baseline;
  - ``functional_ce`` with ``inplace_grad=True`` (and ``return_outputs=False``).

The quick run measures the two loss forms on 2 processes at N=1024; ``--full`` the memory targets
of bench/RESULTS.md (logits [4096, 128256], hidden N=2048, H=512, V=32768) on 2 and 4 processes,
the FSDP2 and pipeline steps, and the N sweep. The section's flags override either.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .dist_worker import MARK
from .measure import Measurement
from .modes import override, pick, sweeps
from .plots import sweep_plots
from .report import Section, Table, ratio, spreads

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LOGITS_BASELINE = "loss_parallel + F.cross_entropy"
HIDDEN_BASELINE = "ColwiseParallel lm_head + loss_parallel"


# --- setups, run in each rank (see bench.dist_worker) --------------------------------------------


def _device(mesh: Any) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def _sharded_logits(mesh: Any, n: int, v: int, dtype: str) -> Any:
    """A leaf DTensor ``[n, v]`` ``Shard(1)``, each rank's shard seeded by its rank (built
    locally: no rank holds the full logits)."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(0), mesh.get_local_rank(0)
    per = -(-v // world)
    size = max(0, min(v, (rank + 1) * per) - min(v, rank * per))
    g = torch.Generator().manual_seed(rank)
    local = (torch.randn(n, size, generator=g) * 2).to(device=_device(mesh), dtype=DTYPES[dtype])
    return DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=(n, v), stride=(v, 1)).requires_grad_()


def _labels(mesh: Any, n: int, v: int) -> torch.Tensor:
    return torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(1234)).to(_device(mesh))


def setup_loss_parallel(*, mesh: Any, n: int, v: int, dtype: str, **_: Any) -> tuple[Callable, Callable]:
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    logits = _sharded_logits(mesh, n, v, dtype)
    labels = distribute_tensor(_labels(mesh, n, v), mesh, [Replicate()])

    def forward() -> Any:
        with loss_parallel():
            return F.cross_entropy(logits.float(), labels)

    def backward(loss: Any) -> None:
        with loss_parallel():
            loss.backward()
        logits.grad = None

    return forward, backward


def _backward_then_clear(*leaves: torch.Tensor) -> Callable[[Any], None]:
    """``backward(loss)``: backpropagate, then drop the leaves' gradients for the next step."""

    def backward(loss: Any) -> None:
        loss.backward()
        for leaf in leaves:
            leaf.grad = None

    return backward


def setup_gather(*, mesh: Any, n: int, v: int, dtype: str, **_: Any) -> tuple[Callable, Callable]:
    import functional_ce

    logits = _sharded_logits(mesh, n, v, dtype)
    labels = _labels(mesh, n, v)
    return (lambda: functional_ce.cross_entropy(logits.full_tensor(), labels)), _backward_then_clear(logits)


def setup_ours(*, mesh: Any, n: int, v: int, dtype: str, inplace: bool = False, **_: Any) -> tuple[Callable, Callable]:
    import functional_ce

    logits = _sharded_logits(mesh, n, v, dtype)
    labels = _labels(mesh, n, v)
    # With inplace_grad each step overwrites the logits with their gradient and the next step
    # reads those values: the work does not depend on them.
    return (lambda: functional_ce.cross_entropy(logits, labels, inplace_grad=inplace)), _backward_then_clear(logits)


def _column_parallel_head(mesh: Any, h: int, v: int, dtype: str) -> torch.nn.Linear:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    head = torch.nn.Linear(h, v, bias=False).to(device=_device(mesh), dtype=DTYPES[dtype])
    head.weight.data.mul_(2.0)  # logits of standard deviation about 2, as in the logits form
    return parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))


def _hidden(mesh: Any, n: int, h: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, h, generator=g).to(device=_device(mesh), dtype=DTYPES[dtype]).requires_grad_()


def setup_colwise_loss_parallel(
    *, mesh: Any, n: int, h: int, v: int, dtype: str, **_: Any
) -> tuple[Callable, Callable]:
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    head = _column_parallel_head(mesh, h, v, dtype)
    hidden = _hidden(mesh, n, h, dtype)
    labels = distribute_tensor(_labels(mesh, n, v), mesh, [Replicate()])

    def forward() -> Any:
        with loss_parallel():
            return F.cross_entropy(head(hidden).float(), labels)

    def backward(loss: Any) -> None:
        with loss_parallel():
            loss.backward()
        head.weight.grad = hidden.grad = None

    return forward, backward


def setup_ours_hidden(*, mesh: Any, n: int, h: int, v: int, dtype: str, **_: Any) -> tuple[Callable, Callable]:
    import functional_ce
    from torch.distributed.tensor import DTensor, Replicate

    head = _column_parallel_head(mesh, h, v, dtype)
    hidden = DTensor.from_local(_hidden(mesh, n, h, dtype).detach(), mesh, [Replicate()], run_check=False)
    hidden.requires_grad_()
    labels = _labels(mesh, n, v)
    forward = lambda: functional_ce.linear_cross_entropy(hidden, head.weight, labels)  # noqa: E731
    return forward, _backward_then_clear(head.weight, hidden)


def _fsdp_llama(mesh: Any, hidden: int, vocab: int, dtype: str) -> Any:
    """A 2-layer Llama with random weights, ``fully_shard`` on each decoder layer and the root."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).to(_device(mesh)).train()
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
    ids = torch.randint(0, v, (max(1, n // 512), min(n, 512)), generator=g).to(_device(mesh))
    batch = {"input_ids": ids, "labels": ids}

    def forward() -> Any:
        return causal_lm_loss(model, **batch) if library else model(**batch).loss

    def backward(loss: Any) -> None:
        loss.backward()
        model.zero_grad(set_to_none=True)

    return forward, backward


def setup_pipeline(*, mesh: Any, n: int, h: int, v: int, dtype: str, library: bool = False,
                   **_: Any) -> tuple[Callable, Callable]:
    """A 2-stage GPipe step (4 microbatches) of a small LM (embedding and a layer | a layer and
    the LM head): ``F.cross_entropy(logits.float())`` as the last stage's loss, or with
    ``library`` ``functional_ce.cross_entropy`` with ``inplace_grad=True`` (``return_outputs=False``).
    Both sum over the microbatch and divide by the global label count (``scale_grads=False``)."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed import pipelining as pp

    import functional_ce

    rank, device = mesh.get_local_rank(0), _device(mesh)
    torch.manual_seed(0)
    first = nn.Sequential(nn.Embedding(v, h), nn.Linear(h, h), nn.Tanh())
    last = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, v))
    module = (first if rank == 0 else last).to(device=device, dtype=DTYPES[dtype])
    stage = pp.PipelineStage(module, rank, 2, device, group=mesh.get_group())
    seq = min(n, 512)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, v, (max(4, n // seq), seq), generator=g).to(device)
    count = ids.numel()

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if library:
            return functional_ce.cross_entropy(out, target, reduction="sum", num_label_tokens=count,
                                               inplace_grad=True)
        return F.cross_entropy(out.float().flatten(0, 1), target.flatten(), reduction="sum") / count

    schedule = pp.ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn, scale_grads=False)

    def forward() -> None:  # the schedule runs forward and backward in one call
        schedule.step(*((ids,) if rank == 0 else ()), target=ids if rank == 1 else None, return_outputs=False)

    def backward(_: Any) -> None:
        module.zero_grad(set_to_none=True)

    return forward, backward


LOGITS_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    LOGITS_BASELINE: ("bench.dist:setup_loss_parallel", {}),
    "full_tensor + functional_ce": ("bench.dist:setup_gather", {}),
    "functional_ce": ("bench.dist:setup_ours", {}),
    "functional_ce inplace": ("bench.dist:setup_ours", {"inplace": True}),
}
HIDDEN_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    HIDDEN_BASELINE: ("bench.dist:setup_colwise_loss_parallel", {}),
    "functional_ce.linear_cross_entropy": ("bench.dist:setup_ours_hidden", {}),
}
PIPELINE_BASELINE = "F.cross_entropy(logits.float())"
PIPELINE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    PIPELINE_BASELINE: ("bench.dist:setup_pipeline", {}),
    "functional_ce inplace, return_outputs=False": ("bench.dist:setup_pipeline", {"library": True}),
}
FSDP_BASELINE = "model(**batch).loss"
FSDP_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    FSDP_BASELINE: ("bench.dist:setup_fsdp_model_loss", {}),
    "model_patches.causal_lm_loss": ("bench.dist:setup_fsdp_model_loss", {"library": True}),
}


# --- launching and reporting, in the bench process -----------------------------------------------


def launch(setup: str, kwargs: dict[str, Any], *, world: int, device: str, repeats: int,
           timeout: float = 900.0) -> Measurement:
    """Run ``setup`` on ``world`` fresh processes; the largest per-rank figures, with every rank's
    in ``extra["ranks"]``."""
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        return Measurement(error=f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-dist-") as tmp:
        spec = {"setup": setup, "kwargs": kwargs, "device": device, "world_size": world, "warmup": 1,
                "repeats": repeats, "init_file": os.path.join(tmp, "rendezvous")}
        env = dict(os.environ)
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # see bench.measure
        env.setdefault("TORCHINDUCTOR_CACHE_DIR",
                       os.path.join(os.path.expanduser("~"), ".cache", "lean-llm-train-inductor"))
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world)]
        procs = [
            subprocess.Popen([sys.executable, "-m", "bench.dist_worker", json.dumps(spec), str(r)],
                             stdout=logs[r], stderr=subprocess.STDOUT, text=True, env=env)
            for r in range(world)
        ]
        try:
            for p in procs:
                p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return Measurement(error=f"timed out after {timeout:.0f} s")
        ranks, failure = [], None
        for r, log in enumerate(logs):
            log.seek(0)
            lines = log.read().splitlines()
            log.close()
            found = [json.loads(x[len(MARK):]) for x in lines if x.startswith(MARK)]
            if found:
                ranks.append(found[0])
            elif failure is None:
                failure = f"rank {r}: " + ((lines[-1:] or [f"exit code {procs[r].returncode}"])[0][:200])
    if failure:
        return Measurement(error=failure)
    peaks = [r["peak_extra_bytes"] for r in ranks]
    spreads = [r.get("spread") for r in ranks]
    return Measurement(
        seconds=max(r["seconds"] for r in ranks),
        peak_extra_bytes=None if None in peaks else max(peaks),
        spread=None if None in spreads else max(spreads),
        extra={"forward_bytes": max(r["forward_bytes"] for r in ranks),
               "backward_bytes": max(r["backward_bytes"] for r in ranks), "ranks": ranks},
    )


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--dist-shape", help="N,V of the logits form (default 1024,128256; --full 4096,128256, the "
                                            "memory target)")
    group.add_argument("--dist-dtype", default="bf16", choices=sorted(DTYPES), help="logits dtype")
    group.add_argument("--dist-hidden-shape", help="N,H,V of the hidden-state form (default 1024,512,32768; --full "
                                                   "2048,512,32768)")
    group.add_argument("--dist-hidden-dtype", default="fp32", choices=sorted(DTYPES),
                       help="hidden-state form dtype (fp32 by default: bf16 matmuls are slow on CPUs "
                            "without bf16 units)")
    group.add_argument("--dist-fsdp-shape", default="2048,256,32000",
                       help="tokens per rank, hidden size, vocabulary of the FSDP2 Llama (default 2048,256,32000)")
    group.add_argument("--dist-pipeline-shape", default="2048,256,32000",
                       help="tokens, hidden size, vocabulary of the 2-stage pipeline (default 2048,256,32000)")
    group.add_argument("--dist-worlds", help="process counts (default 2; --full 2,4)")
    group.add_argument("--dist-models", choices=["on", "off"],
                       help="the FSDP2 and pipeline training-step tables (default off; --full on)")
    group.add_argument("--dist-repeats", type=int, default=2, help="timed steps per variant (median)")
    group.add_argument("--dist-sweep", default="512,1024,2048,4096",
                       help="token counts N for the --plot sweep (2 processes; V from --dist-shape)")


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the quick or full defaults of the flags the user left unset."""
    return override(args, dist_shape=pick(args, args.dist_shape, "1024,128256", "4096,128256"),
                    dist_hidden_shape=pick(args, args.dist_hidden_shape, "1024,512,32768", "2048,512,32768"),
                    dist_worlds=pick(args, args.dist_worlds, "2", "2,4"),
                    dist_models=pick(args, args.dist_models, "off", "on"))


def count(args: argparse.Namespace) -> int:
    """Progress steps: one per variant launched."""
    a = _resolved(args)
    worlds = len(a.dist_worlds.split(","))
    steps = worlds * (len(LOGITS_VARIANTS) + len(HIDDEN_VARIANTS))
    if a.dist_models == "on":
        steps += worlds * len(FSDP_VARIANTS) + len(PIPELINE_VARIANTS)
    if sweeps(a):
        steps += len(a.dist_sweep.split(",")) * (len(LOGITS_VARIANTS) + len(HIDDEN_VARIANTS))
    return steps


def _command(args: argparse.Namespace) -> str:
    return "python -m bench --only dist " + " ".join(shlex.quote(a) for a in [
        "--dist-shape", args.dist_shape, "--dist-dtype", args.dist_dtype, "--dist-hidden-shape",
        args.dist_hidden_shape, "--dist-hidden-dtype", args.dist_hidden_dtype, "--dist-fsdp-shape",
        args.dist_fsdp_shape, "--dist-pipeline-shape", args.dist_pipeline_shape,
        "--dist-worlds", args.dist_worlds, "--dist-models", args.dist_models,
        "--device", args.device,
    ])


def _measure_all(variants: dict[str, tuple[str, dict[str, Any]]], shape: dict[str, Any], world: int,
                 args: argparse.Namespace, tick: Callable[[str], None]) -> dict[str, Measurement]:
    out = {}
    for name, (setup, extra) in variants.items():
        tick(f"dist {name} x{world} N={shape['n']}")
        out[name] = launch(setup, {**shape, **extra}, world=world, device=args.device, repeats=args.dist_repeats)
    return out


def _rows(results: dict[int, dict[str, Measurement]], baseline: str, n: int) -> list[list[Any]]:
    rows = []
    for world, by_variant in results.items():
        base = by_variant[baseline]
        for name, m in by_variant.items():
            fwd, bwd = m.extra.get("forward_bytes"), m.extra.get("backward_bytes")
            rows.append([
                world, name, m.ms, m.peak_mib, ratio(m.peak_extra_bytes, base.peak_extra_bytes),
                None if fwd is None else fwd / n, None if bwd is None else bwd / 2**20, m.error or "ok",
            ])
    return rows


#: (measurement key, axis label, scale, file suffix) of the sweep's plots, per rank.
SWEEP_METRICS = (
    ("peak_extra_bytes", "peak extra memory per rank (MiB)", 1 / 2**20, "memory"),
    ("forward_bytes", "forward bytes to collectives per rank (MiB)", 1 / 2**20, "forward_bytes"),
    ("backward_bytes", "backward bytes to collectives per rank (MiB)", 1 / 2**20, "backward_bytes"),
    ("seconds", "forward+backward time (ms)", 1e3, "time"),
)
COLUMNS = ["ranks", "variant", "time (ms)", "peak extra/rank (MiB)", "x baseline", "fwd bytes/token/rank",
           "bwd MiB/rank", "status"]


def run(args: argparse.Namespace, tick: Callable[[str], None]) -> Section:
    args = _resolved(args)
    n, v = (int(x) for x in args.dist_shape.split(","))
    hn, hh, hv = (int(x) for x in args.dist_hidden_shape.split(","))
    worlds = [int(x) for x in args.dist_worlds.split(",")]
    logits_shape = {"n": n, "v": v, "dtype": args.dist_dtype}
    hidden_shape = {"n": hn, "h": hh, "v": hv, "dtype": args.dist_hidden_dtype}
    logits = {w: _measure_all(LOGITS_VARIANTS, logits_shape, w, args, tick) for w in worlds}
    hidden = {w: _measure_all(HIDDEN_VARIANTS, hidden_shape, w, args, tick) for w in worlds}
    mem_how = "CUDA max_memory_allocated" if args.device.startswith("cuda") else "peak RSS of each rank's process"
    notes = [
        f"per rank: the largest over ranks; peak extra memory = {mem_how} above the inputs during the step "
        "(the logits' gradient counts); bytes = what each rank hands to collectives (counted in one extra eager step)",
    ]
    tables = [
        Table(title=f"vocabulary-parallel cross-entropy from logits, forward+backward, [{n}, {v}] {args.dist_dtype} "
                    f"sharded over the vocabulary, {args.device}",
              columns=COLUMNS, rows=_rows(logits, LOGITS_BASELINE, n),
              baseline=f"{LOGITS_BASELINE}: torch's loss_parallel() on logits.float(), the same ranks",
              notes=notes, command=_command(args), keys=2, spread=_spreads(logits)),
        Table(title=f"vocabulary-parallel hidden-state loss, forward+backward, N={hn}, H={hh}, V={hv} "
                    f"{args.dist_hidden_dtype}, column-parallel lm_head, {args.device}",
              columns=COLUMNS, rows=_rows(hidden, HIDDEN_BASELINE, hn),
              baseline=f"{HIDDEN_BASELINE}: F.cross_entropy(lm_head(hidden).float()) under loss_parallel()",
              notes=notes, command=_command(args), keys=2, spread=_spreads(hidden)),
    ]
    data: dict[str, Any] = {
        "logits": {"shape": [n, v], "dtype": args.dist_dtype,
                   "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in logits.items()}},
        "hidden": {"shape": [hn, hh, hv], "dtype": args.dist_hidden_dtype,
                   "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in hidden.items()}},
        "device": args.device,
    }
    if args.dist_models == "on":
        model_tables, model_data = _training_steps(args, worlds, notes, tick)
        tables += model_tables
        data.update(model_data)
    if sweeps(args):
        for form, variants, shape in (("logits", LOGITS_VARIANTS, logits_shape), ("hidden", HIDDEN_VARIANTS,
                                                                                    hidden_shape)):
            sweep = {}
            for sn in (int(x) for x in args.dist_sweep.split(",")):
                measured = _measure_all(variants, {**shape, "n": sn}, 2, args, tick)
                sweep[sn] = {k: _flat(m) for k, m in measured.items()}
            data[form]["sweep"] = {"world": 2, "by_n": sweep}
    return Section(name="functional_ce: vocabulary-parallel losses (DTensor)", tables=tables, data=data)


def _training_steps(args: argparse.Namespace, worlds: list[int], notes: list[str],
                    tick: Callable[[str], None]) -> tuple[list[Table], dict[str, Any]]:
    """The FSDP2 Llama step (every world) and the 2-stage pipeline step (2 processes)."""
    fn, fh, fv = (int(x) for x in args.dist_fsdp_shape.split(","))
    fsdp_shape = {"n": fn, "h": fh, "v": fv, "dtype": "fp32"}
    fsdp = {w: _measure_all(FSDP_VARIANTS, fsdp_shape, w, args, tick) for w in worlds}
    pn, ph, pv = (int(x) for x in args.dist_pipeline_shape.split(","))
    pipeline_shape = {"n": pn, "h": ph, "v": pv, "dtype": "fp32"}
    pipeline = {2: _measure_all(PIPELINE_VARIANTS, pipeline_shape, 2, args, tick)}
    tables = [
        Table(title=f"FSDP2 training step, 2-layer Llama (hidden {fh}, V={fv}) fp32, {fn} tokens per rank, "
                    f"fully_shard on each layer and the root, {args.device}",
              columns=COLUMNS, rows=_rows(fsdp, FSDP_BASELINE, fn),
              baseline=f"{FSDP_BASELINE}: the model's own loss (fp32 logits and their log-softmax)",
              notes=notes[:1] + [f"one fp32 logits copy here: {fn} x {fv} x 4 bytes = {fn * fv * 4 / 2**20:.0f} MiB"],
              command=_command(args), keys=2, spread=_spreads(fsdp)),
        Table(title=f"2-stage pipeline (GPipe, 4 microbatches), {pn} tokens, hidden {ph}, V={pv} fp32, the last "
                    f"stage's loss_fn, {args.device}",
              columns=COLUMNS, rows=_rows(pipeline, PIPELINE_BASELINE, pn),
              baseline=f"{PIPELINE_BASELINE}: summed over the microbatch, divided by the global label count",
              notes=notes[:1] + ["one step = schedule.step (forward and backward of every microbatch); the "
                                 "activations the stages send each other (point-to-point) are not counted"],
              command=_command(args), keys=2, spread=_spreads(pipeline)),
    ]
    data = {
        "fsdp": {"shape": [fn, fh, fv], "dtype": "fp32",
                 "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in fsdp.items()}},
        "pipeline": {"shape": [pn, ph, pv], "dtype": "fp32",
                     "by_world": {w: {k: vars(m) for k, m in r.items()} for w, r in pipeline.items()}},
    }
    return tables, data


def _spreads(results: dict[int, dict[str, Measurement]]) -> dict[str, float]:
    """Row name (``"ranks / variant"``) -> the spread of its timed steps."""
    return {f"{world} / {name}": spread for world, by_variant in results.items()
            for name, spread in spreads(by_variant).items()}


def _flat(m: Measurement) -> dict[str, Any]:
    """A measurement as the plots read it: time, peak memory and bytes at the top level."""
    out = {k: v for k, v in vars(m).items() if k != "extra"}
    for key in ("forward_bytes", "backward_bytes"):
        out[key] = m.extra.get(key)
    return out


def plot(section: Section, out_dir: Path) -> list[Path]:
    """Per-rank peak memory, communicated bytes (forward, backward) and time against N, at 2
    processes, one line per variant, for each form."""
    paths = []
    for form, what in (("logits", "CE from logits"), ("hidden", "hidden-state CE")):
        data = section.data[form]
        sweep = data.get("sweep") or {}
        sizes = {k: x for k, x in zip("NHV" if form == "hidden" else "NV", data["shape"]) if k != "N"}
        paths += sweep_plots(sweep.get("by_n"), out_dir, stem=f"dist_{form}", what=f"vocabulary-parallel {what}",
                             sizes=sizes, details=[f"{sweep.get('world')} ranks", data["dtype"]], metrics=SWEEP_METRICS)
    return paths
