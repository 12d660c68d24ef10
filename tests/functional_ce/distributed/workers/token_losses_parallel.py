"""What each process of a :class:`bench.harness.dist_pool.DistPool` runs for the vocabulary-parallel and
FSDP2 tests of token log-probs (with entropy) and distillation.

Every task rebuilds the seeded full inputs (identical on every rank), places them as the layout
says, runs the loss and backward with a seeded per-token upstream gradient, counts the bytes
handed to collectives in forward and backward, and computes the fp64 single-process reference of
the same call itself. It returns plain tensors for the parent process to compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import functional_ce
from bench.harness.comm_bytes import CommBytes
from tests.functional_ce.distributed.workers.vocab_parallel import placements
from tests.support.reference import reference_generalized_jsd, reference_token_logprobs, reference_token_stats


@dataclasses.dataclass
class TokenCase:
    """A token log-prob or distillation call: ``loss`` ``"logprobs"`` or ``"distillation"``, from
    ``form`` ``"logits"`` or ``"linear"``, with the vocabulary sharded on ``mesh_dim``.

    ``token_dim``: hidden states sequence-parallel over that token dim (None: ``Replicate()``);
    ``teacher_h``: the teacher's hidden size; ``teacher_grad``: the teacher requires grad;
    ``opts``: the call's keywords (``mask=True`` becomes a random per-token mask);
    ``grad_to``: the indices of the outputs that get an upstream gradient (None: every float
    output; ``()``: none, so nothing runs backward); ``dtensor_upstream``: the upstream gradient
    is applied by DTensor ops on the outputs (as a user's loss would), not on their local values.
    """

    loss: str
    form: str
    mesh_dim: int
    seed: int
    batch_shape: tuple[int, ...]
    v: int
    dtype: torch.dtype
    opts: dict[str, Any]
    h: int = 8
    bias: bool = False
    token_dim: Optional[int] = None
    teacher_h: int = 12
    teacher_grad: bool = False
    labels: bool = True
    grad_to: Optional[tuple[int, ...]] = None
    dtensor_upstream: bool = False


@dataclasses.dataclass
class Inputs:
    """Seeded full inputs of a case (the same on every process)."""

    student: tuple[torch.Tensor, ...]  # (logits,) or (hidden, weight[, bias])
    teacher: tuple[torch.Tensor, ...]
    labels: Optional[torch.Tensor]
    opts: dict[str, Any]
    counted: torch.Tensor  # bool [...]: where a token counts


def make_inputs(case: TokenCase) -> Inputs:
    g = torch.Generator().manual_seed(case.seed)
    shape = case.batch_shape

    def head(h: int) -> tuple[torch.Tensor, ...]:
        if case.form == "logits":
            return ((torch.randn(*shape, case.v, generator=g) * 3).to(case.dtype),)
        out = (torch.randn(*shape, h, generator=g).to(case.dtype),
               (torch.randn(case.v, h, generator=g) * (3 / math.sqrt(h))).to(case.dtype))
        return out + ((torch.randn(case.v, generator=g).to(case.dtype),) if case.bias else ())

    student, teacher = head(case.h), head(case.teacher_h)
    labels = None
    counted = torch.ones(shape, dtype=torch.bool)
    if case.labels:
        labels = torch.randint(0, case.v, shape, generator=g)
        ignore = case.opts.get("ignore_index", -100)
        labels[torch.rand(shape, generator=g) < 0.25] = ignore
        counted &= labels != ignore
    opts = dict(case.opts)
    if opts.get("mask") is True:
        opts["mask"] = torch.rand(shape, generator=g) < 0.7
        counted &= opts["mask"]
    return Inputs(student, teacher, labels, opts, counted)


def _logits64(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    return torch.nn.functional.linear(*(t.double() for t in parts))


def _upstream(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) - 0.3


def _outputs(case: TokenCase, out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _weighted(outputs: list[torch.Tensor], seed: int, grad_to: Optional[tuple[int, ...]]) -> Optional[torch.Tensor]:
    """``sum(upstream * output)`` over the float outputs in ``grad_to`` (None: all), with a seeded
    per-token upstream gradient; None when no output gets one."""
    terms = [(o * _like(o, _upstream(o.shape, seed + i).to(o.dtype))).sum() for i, o in enumerate(outputs)
             if o.is_floating_point() and (grad_to is None or i in grad_to)]
    return sum(terms) if terms else None


def _like(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` (the same on every process) as a DTensor placed like ``o`` when ``o`` is one."""
    if not isinstance(o, DTensor):
        return t
    return DTensor.from_local(t, o.device_mesh, o.placements, run_check=False)


def _backward(loss: Optional[torch.Tensor]) -> None:
    """Backward of ``loss``; nothing when no output got an upstream gradient."""
    if loss is not None:
        loss.backward()


def call(case: TokenCase, student: tuple, teacher: tuple, labels: Any, opts: dict[str, Any]) -> Any:
    """The public function of ``case`` on the given (plain or DTensor) inputs."""
    if case.loss == "logprobs":
        if case.form == "logits":
            return functional_ce.token_logprobs(student[0], labels, **opts)
        bias = student[2] if len(student) > 2 else None
        return functional_ce.linear_token_logprobs(student[0], student[1], labels, bias=bias, **opts)
    if case.form == "logits":
        return functional_ce.distillation_loss(student[0], teacher[0], labels=labels, **opts)
    return functional_ce.linear_distillation_loss(
        student[0], student[1], teacher[0], teacher[1], student_bias=student[2] if len(student) > 2 else None,
        teacher_bias=teacher[2] if len(teacher) > 2 else None, labels=labels, **opts)


def reference(case: TokenCase, inputs: Inputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fp64 single-process outputs and the gradients of every input that requires grad
    (the student's, then the teacher's when ``teacher_grad``)."""
    student = [t.detach().double().requires_grad_() for t in inputs.student]
    teacher = [t.detach().double().requires_grad_(case.teacher_grad) for t in inputs.teacher]
    opts = inputs.opts
    if case.loss == "logprobs":
        ignore = opts.get("ignore_index", -100)
        labels = inputs.labels if opts.get("mask") is None else torch.where(opts["mask"], inputs.labels, ignore)
        scaling = {"temperature": opts.get("temperature", 1.0), "softcap": opts.get("softcap"),
                   "logit_scale": opts.get("logit_scale", 1.0), "ignore_index": ignore}
        logits = _logits64(tuple(student))
        logp, entropy = reference_token_logprobs(logits, labels, **scaling)
        outs = [logp, entropy] if opts.get("return_entropy") else [logp]
        outs += reference_token_stats(logits, labels, tuple(opts.get("stats", ())), **scaling)
    else:
        outs = [reference_generalized_jsd(
            _logits64(tuple(student)), _logits64(tuple(teacher)), inputs.counted, beta=opts.get("beta", 0.5),
            temperature=opts.get("temperature", 1.0), reduction=opts.get("reduction", "mean"),
            num_label_tokens=opts.get("num_label_tokens"),
            **{k: opts[k] for k in ("softcap", "teacher_softcap", "logit_scale", "teacher_logit_scale") if k in opts})]
    leaves = student + (teacher if case.teacher_grad else [])
    loss = _weighted(outs, case.seed + 1, case.grad_to)
    grads = [None] * len(leaves) if loss is None else torch.autograd.grad(loss, leaves)
    return [o.detach() for o in outs], list(grads)


@dataclasses.dataclass
class TokenResult:
    """One process's view of one call, and its own fp64 reference."""

    outputs: list[torch.Tensor]  # the local values of the Replicate() outputs
    grads: list[Optional[torch.Tensor]]  # full (gathered) gradients: the student's inputs, then the teacher's
    grad_placements: list[tuple]
    output_placements: list[tuple]
    forward_bytes: int
    forward_by_op: dict[str, int]
    backward_bytes: int
    backward_by_op: dict[str, int]
    reference: tuple[list[torch.Tensor], list[torch.Tensor]]


def vocab_parallel_case(mesh: Any, case: TokenCase, compile: Optional[str] = None) -> Optional[TokenResult]:
    """Logits ``Shard(-1)``, or heads ``Shard(0)`` with hidden states ``Replicate()`` or
    sequence-parallel, on ``case.mesh_dim``; labels and mask plain tensors. ``compile``: a
    ``torch.compile`` backend for the call (``fullgraph=True``; bytes are then not counted)."""
    if mesh is None:
        return None
    inputs = make_inputs(case)

    def place(parts: tuple[torch.Tensor, ...], grad: bool) -> list[DTensor]:
        if case.form == "logits":
            shards = [Shard(parts[0].dim() - 1)]
        else:
            shards = [Replicate() if case.token_dim is None else Shard(case.token_dim), Shard(0), Shard(0)]
        return [distribute_tensor(t, mesh, placements(mesh.ndim, case.mesh_dim, s)).requires_grad_(grad)
                for t, s in zip(parts, shards)]

    student, teacher = place(inputs.student, True), place(inputs.teacher, case.teacher_grad)
    fn = call
    if compile is not None:
        torch._dynamo.reset()
        fn = torch.compile(call, backend=compile, fullgraph=True)
    with (CommBytes() if compile is None else contextlib.nullcontext(CommBytes())) as fwd:
        out = fn(case, student, teacher, inputs.labels, {**inputs.opts, "compile_chunks": False})
    outputs = _outputs(case, out)
    leaves = student + (teacher if case.teacher_grad else [])
    with CommBytes() as bwd:
        weighted = _weighted(outputs if case.dtensor_upstream else [o.to_local() for o in outputs],
                             case.seed + 1, case.grad_to)
        _backward(weighted)
    return TokenResult(
        [o.to_local().detach().clone() for o in outputs],
        [None if t.grad is None else t.grad.full_tensor() for t in leaves],
        [tuple(t.grad.placements) for t in leaves if t.grad is not None], [tuple(o.placements) for o in outputs],
        fwd.bytes, dict(fwd.by_op), bwd.bytes, dict(bwd.by_op), reference(case, inputs),
    )


def fsdp_case(mesh: Any, case: TokenCase) -> Optional[dict[str, Any]]:
    """FSDP2's layout: every head's parameters ``Shard(0)`` on every mesh dim, hidden states and
    labels plain (here the same on every process). Each process's outputs are its own; each
    weight's gradient is the sum over processes of the per-process gradients."""
    if mesh is None:
        return None
    inputs = make_inputs(case)
    layout = [Shard(0)] * mesh.ndim

    def place(parts: tuple[torch.Tensor, ...], grad: bool) -> list[torch.Tensor]:
        hidden, *params = parts
        return [hidden.clone().requires_grad_(grad)] + [distribute_tensor(p, mesh, layout).requires_grad_(grad)
                                                        for p in params]

    student, teacher = place(inputs.student, True), place(inputs.teacher, case.teacher_grad)
    out = call(case, student, teacher, inputs.labels, {**inputs.opts, "compile_chunks": False})
    outputs = _outputs(case, out)
    leaves = student + (teacher if case.teacher_grad else [])
    with CommBytes() as bwd:
        _backward(_weighted(outputs, case.seed + 1, case.grad_to))
    grads = [t.grad.full_tensor() if isinstance(t.grad, DTensor) else t.grad for t in leaves]
    return {"outputs": [o.detach() for o in outputs], "plain": not any(isinstance(o, DTensor) for o in outputs),
            "grads": grads, "grad_placements": [tuple(t.grad.placements) for t in leaves if isinstance(t.grad, DTensor)],
            "backward_by_op": dict(bwd.by_op), "reference": reference(case, inputs),
            "world": mesh.size()}


def many(mesh: Any, task: Any, cases: list[TokenCase]) -> Optional[list[Any]]:
    return None if mesh is None else [task(mesh, c) for c in cases]


def mismatched_teacher(mesh: Any, what: str) -> Optional[str]:
    """The error a student and a teacher placed differently raise (``what``: the mismatch)."""
    if mesh is None:
        return None
    s, t = torch.randn(4, 10), torch.randn(4, 10)
    vocab = placements(mesh.ndim, 0, Shard(1))
    try:
        if what == "logits placements":
            functional_ce.distillation_loss(distribute_tensor(s, mesh, vocab),
                                            distribute_tensor(t, mesh, [Replicate()] * mesh.ndim))
        elif what == "one DTensor, one plain":
            functional_ce.distillation_loss(distribute_tensor(s, mesh, vocab), t)
        elif what == "teacher weight placements":
            h, w = torch.randn(4, 3), torch.randn(10, 3)
            rep = [Replicate()] * mesh.ndim
            functional_ce.linear_distillation_loss(
                distribute_tensor(h, mesh, rep), distribute_tensor(w, mesh, placements(mesh.ndim, 0, Shard(0))),
                distribute_tensor(h, mesh, rep), distribute_tensor(w, mesh, rep))
        else:
            raise KeyError(what)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
