"""The loss functions over a vocabulary sharded with DTensor (tensor parallelism).

Every loss of :mod:`functional_ce` (cross-entropy, token log-probs with entropy, distillation; each
from logits and from hidden states) hands DTensor inputs to :func:`vocab_parallel_loss`.
Each process runs the chunk driver on its own slice of the vocabulary (the logits' local shard, or
the logits it builds from its rows of the LM head's weight); :func:`combine_stats` combines the
per-slice statistics with O(N) collectives over the vocabulary's mesh dim, so every option keeps
its single-process meaning over the full vocabulary. Backward is local: from logits it needs no
communication at all; from hidden states the only one is DTensor's own reduction of the partial
hidden gradient (an all-reduce, or a reduce-scatter under sequence parallelism). The loss is a
DTensor ``Replicate()`` on every mesh dim.

A layout is accepted when the vocabulary is sharded (``Shard`` on the class dim) over at most
one mesh dim and every other mesh dim is ``Replicate()``; token rows are whole on every process.
Everything else raises ``ValueError`` naming the placements and the supported layouts.
Vocabulary shards follow DTensor's own rule (``torch.chunk``): ``ceil(V / p)`` classes per
process, the last ones smaller or empty.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from .. import operators
from ..inputs import make_spec

LOGITS_LAYOUTS = (
    "logits: Shard(-1) (the vocabulary) on at most one mesh dim and Replicate() on every other mesh dim"
)
WEIGHT_LAYOUTS = (
    "weight [V, H]: Shard(0) (a column-parallel lm_head) on at most one mesh dim and Replicate() on every "
    "other; hidden: a DTensor on the same mesh, Replicate() or Shard(token dim) (sequence parallel) on the "
    "weight's shard dim and Replicate() elsewhere; bias: sharded like the weight"
)


@dataclasses.dataclass(frozen=True)
class VocabSlice:
    """Which classes this process holds.

    Attributes:
        mesh: the device mesh of the sharded input.
        mesh_dim: the mesh dim that shards the vocabulary, or None when it is not sharded.
        start: the class id of this process's first column.
        size: how many classes this process holds (may be 0).
        n_classes: the full vocabulary size V.
    """

    mesh: DeviceMesh
    mesh_dim: Optional[int]
    start: int
    size: int
    n_classes: int


def _describe(placements: Sequence[Placement]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def vocab_slice(t: DTensor, class_dim: int, what: str, layouts: str) -> VocabSlice:
    """The vocabulary slice of ``t`` whose classes run along ``class_dim``; raises ``ValueError``
    for any other placement than ``Shard(class_dim)`` on one mesh dim and ``Replicate()``."""
    class_dim = class_dim % t.dim()
    mesh, placements = t.device_mesh, t.placements
    shard_dims = []
    for i, p in enumerate(placements):
        if type(p) is Shard and p.dim % t.dim() == class_dim:
            shard_dims.append(i)
        elif not isinstance(p, Replicate):
            raise ValueError(
                f"{what} has placements {_describe(placements)}: {p!r} on mesh dim {i} is not supported. "
                f"Supported: {layouts}"
            )
    if len(shard_dims) > 1:
        raise ValueError(
            f"{what} has placements {_describe(placements)}: the vocabulary is sharded on mesh dims {shard_dims}, "
            f"at most one is supported. Supported: {layouts}"
        )
    n_classes = t.shape[class_dim]
    if not shard_dims:
        return VocabSlice(mesh, None, 0, n_classes, n_classes)
    mesh_dim = shard_dims[0]
    ranks = mesh.size(mesh_dim)
    per_rank = -(-n_classes // ranks)
    start = min(mesh.get_local_rank(mesh_dim) * per_rank, n_classes)
    size = min(n_classes, start + per_rank) - start
    local = t.to_local().shape[class_dim]
    if local != size:
        raise ValueError(
            f"{what}'s local shard has {local} classes where DTensor's Shard rule gives {size} "
            f"(V={n_classes} over {ranks} processes); build it with distribute_tensor or from_local with even "
            "chunks as torch.chunk makes them"
        )
    return VocabSlice(mesh, mesh_dim, start, size, n_classes)


def replicated_local(name: str, t: object, mesh: DeviceMesh) -> object:
    """A per-token argument (labels, mask, weights, a count) as a plain local tensor: a plain
    tensor is taken as it is (it must be the same on every process), a DTensor must be
    ``Replicate()`` on every dim of ``mesh``."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh != mesh or not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(
            f"{name} is a DTensor with placements {_describe(t.placements)} on mesh {t.device_mesh}; it must cover "
            f"all tokens on every process: a plain tensor, or a DTensor Replicate() on every dim of the input's "
            f"mesh {mesh} (labels sharded differently from the rows are not supported)"
        )
    return t.to_local()


def replicate_result(result: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """The loss (the same on every process) as a DTensor ``Replicate()`` on every mesh dim."""
    return DTensor.from_local(result, mesh, [Replicate()] * mesh.ndim, run_check=False)


def combine_stats(stats: torch.Tensor, kinds: Sequence[str], vocab: VocabSlice) -> torch.Tensor:
    """Full-vocabulary statistics ``[N, k]`` fp32 from this slice's, column ``i`` of kind ``kinds[i]``.

    Kinds (see :mod:`functional_ce.maths`): ``"lse"`` (a logsumexp), ``"sum"`` (a sum over the
    slice), ``"max"`` (a maximum; its MAX is the full value) and ``"mean@j"`` (a mean under the slice's own softmax of the ``"lse"`` column ``j``;
    the full mean weights each slice's by its mass ``exp(lse_slice - lse)``). Two all-reduces over
    the vocabulary's mesh dim: a MAX of the ``"lse"`` and ``"max"`` columns (4 bytes per row and
    column; none without such a column), then one SUM of ``exp(lse_slice - max)``, the ``"sum"``
    columns and the mass-weighted means, 4 bytes per row and column. Cross-entropy: 12 bytes per row in all, 16
    with label smoothing; token log-probs 12, 16 with the entropy; distillation 16 for its
    logsumexps, then 4 or 8 for its divergences. No collective when the vocabulary is not sharded.
    """
    if vocab.mesh_dim is None:
        return stats
    group = (vocab.mesh, vocab.mesh_dim)
    cols = stats.unbind(-1)
    lse = [i for i, kind in enumerate(kinds) if kind == "lse"]
    maxed = [i for i, kind in enumerate(kinds) if kind == "max"]
    weighted_by = {i: int(kind.split("@")[1]) for i, kind in enumerate(kinds) if kind.startswith("mean@")}
    unknown = [k for k in kinds if k not in ("lse", "sum", "max") and not k.startswith("mean@")]
    if unknown:
        raise ValueError(f"unknown statistic kinds {unknown}; expected 'lse', 'sum', 'max' or 'mean@<lse column>'")
    top: Sequence[torch.Tensor] = ()
    if lse or maxed:  # a pass of plain sums (a divergence given the logsumexps) needs no MAX
        top = funcol.all_reduce(torch.stack([cols[i] for i in lse + maxed], -1), "max", group).unbind(-1)
        top = [torch.where(torch.isfinite(t), t, 0.0) if j < len(lse) else t  # all -inf rows stay -inf
               for j, t in enumerate(top)]
    mass = {i: torch.exp(cols[i] - top[lse.index(i)]) for i in lse}  # this slice's share, up to a factor
    parts = [mass[i] if i in lse else cols[i] * mass[weighted_by[i]] if i in weighted_by else c
             for i, c in enumerate(cols) if i not in maxed]
    kept = [i for i in range(len(cols)) if i not in maxed]
    summed = dict(zip(kept, funcol.all_reduce(torch.stack(parts, -1), "sum", group).unbind(-1)))

    def full(i: int, s: torch.Tensor) -> torch.Tensor:
        if i in maxed:
            return top[len(lse) + maxed.index(i)]
        if i in lse:
            return top[lse.index(i)] + torch.log(s)
        if i in weighted_by:  # sum_slices(mass * mean) / sum_slices(mass); 0 where no class has mass
            total = summed[weighted_by[i]]
            return torch.where(total > 0, s / torch.where(total > 0, total, 1.0), 0.0)
        return s

    return torch.stack([full(i, summed.get(i)) for i in range(len(cols))], -1)


def _check_hidden_layout(hidden: object, weight: DTensor, vocab: VocabSlice) -> DTensor:
    if not isinstance(hidden, DTensor):
        raise ValueError(
            "weight is a DTensor but hidden is a plain tensor: the vocabulary-parallel hidden-state loss needs "
            f"hidden as a DTensor on the weight's mesh. Supported: {WEIGHT_LAYOUTS}"
        )
    if hidden.device_mesh != vocab.mesh:
        raise ValueError(f"hidden is on mesh {hidden.device_mesh} but weight is on {vocab.mesh}; use one mesh")
    token_dims = range(hidden.dim() - 1)
    for i, p in enumerate(hidden.placements):
        on_vocab_dim = i == vocab.mesh_dim
        if isinstance(p, Replicate) or (on_vocab_dim and type(p) is Shard and p.dim % hidden.dim() in token_dims):
            continue
        raise ValueError(
            f"hidden has placements {tuple(hidden.placements)} and weight {tuple(weight.placements)}: {p!r} on mesh "
            f"dim {i} is not supported. Supported: {WEIGHT_LAYOUTS}"
        )
    return hidden


def _check_bias_layout(bias: object, weight: DTensor) -> Optional[DTensor]:
    if bias is None:
        return None
    if not isinstance(bias, DTensor) or bias.device_mesh != weight.device_mesh or tuple(bias.placements) != tuple(
        Shard(0) if isinstance(p, Shard) else p for p in weight.placements
    ):
        shown = tuple(bias.placements) if isinstance(bias, DTensor) else "a plain tensor"
        raise ValueError(f"bias must be sharded like the weight {tuple(weight.placements)}, got {shown}")
    return bias


def _local_hidden(hidden: object, weight: object, bias: object) -> tuple:
    """``(vocab slice, hidden [N, H] local, weight slice, bias slice)`` of a column-parallel head.

    Sequence-parallel tokens are gathered first (DTensor's all-gather of ``[N, H]``); the local
    hidden states get a ``Partial`` gradient on the vocabulary's mesh dim, so DTensor reduces the
    hidden gradient once (an all-reduce, or a reduce-scatter for sequence-parallel tokens).
    """
    if not isinstance(weight, DTensor):
        raise ValueError(
            "hidden is a DTensor but weight is a plain tensor: the vocabulary-parallel hidden-state loss needs "
            f"the weight as a DTensor. Supported: {WEIGHT_LAYOUTS}"
        )
    vocab = vocab_slice(weight, 0, "weight", WEIGHT_LAYOUTS)
    mesh = vocab.mesh
    hidden = _check_hidden_layout(hidden, weight, vocab)
    bias = _check_bias_layout(bias, weight)
    replicate = [Replicate()] * mesh.ndim
    grad_placements = list(replicate)
    if vocab.mesh_dim is not None:
        grad_placements[vocab.mesh_dim] = Partial()  # each process's hidden gradient covers its classes only
    # Redistribute even when hidden is Replicate(): its backward turns the Partial gradient into
    # hidden's own placements (all-reduce, or reduce-scatter for sequence-parallel tokens).
    h_local = hidden.redistribute(mesh, replicate).to_local(grad_placements=grad_placements)
    h = h_local.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])
    return vocab, h, weight.to_local(), None if bias is None else bias.to_local()


def _same_layout(what: str, student: object, teacher: object) -> None:
    """The teacher's DTensor must be placed like the student's (one mesh, the same placements)."""
    if student is None and teacher is None:
        return
    if not isinstance(teacher, DTensor) or not isinstance(student, DTensor):
        raise ValueError(f"student and teacher {what} must share one layout: one is a DTensor and the other is not")
    if teacher.device_mesh != student.device_mesh or tuple(teacher.placements) != tuple(student.placements):
        raise ValueError(
            f"student and teacher {what} must share one layout: the student's are {_describe(student.placements)} "
            f"on {student.device_mesh}, the teacher's {_describe(teacher.placements)} on {teacher.device_mesh}"
        )


def vocab_parallel_loss(form: str, x: DTensor, weight: object, bias: object, labels: object,
                        options: dict[str, Any], *, loss: str = "cross_entropy",
                        second: Optional[tuple] = None, teacher_grad: bool = False) -> DTensor:
    """A loss of :mod:`functional_ce` (``loss``, a key of :data:`functional_ce.maths.LOSSES`) over a
    vocabulary sharded with DTensor: from logits (``form="logits"``, ``x`` a DTensor ``[..., V]``,
    see :data:`LOGITS_LAYOUTS`) or from hidden states (``form="linear"``, see :data:`WEIGHT_LAYOUTS`).

    ``second`` is the teacher ``(x2, weight2, bias2)`` of a distillation loss, placed exactly as
    the student's inputs (its gradient is computed when ``teacher_grad``). ``labels``, ``mask``,
    ``weights`` and a tensor ``num_label_tokens`` are plain tensors equal on every process, or
    DTensors ``Replicate()`` on the input's mesh. With ``inplace_grad`` each process's gradient
    shard overwrites its own local logits. No ``[N, V]`` or ``[N, V / p]`` tensor is built from
    hidden states; their backward recomputes each chunk's local logits. Gradients have their
    inputs' placements. Returns a DTensor ``Replicate()`` (``[..., m]`` for a loss with ``m``
    outputs per token).
    """
    x2, weight2, bias2 = (None, None, None) if second is None else second
    if second is not None:
        for what, a, b in (("logits" if form == "logits" else "hidden states", x, x2), ("weights", weight, weight2),
                           ("biases", bias, bias2)):
            if not (what == "biases" and (a is None or b is None)):
                _same_layout(what, a, b)
    if form == "logits":
        vocab = vocab_slice(x, -1, "logits", LOGITS_LAYOUTS)
        n = math.prod(x.shape[:-1])
        x_local, w, b = x.to_local().reshape(n, vocab.size), None, None
        local2 = None if x2 is None else (x2.to_local().reshape(n, vocab.size), None, None)
    else:
        vocab, x_local, w, b = _local_hidden(x, weight, bias)
        local2 = None if x2 is None else _local_hidden(x2, weight2, bias2)[1:]
    options = {name: replicated_local(name, t, vocab.mesh) if name in _TOKEN_ARGS else t
               for name, t in options.items()}
    labels = replicated_local("labels", labels, vocab.mesh)
    spec, tokens = make_spec(form, options, labels, loss=loss, batch_shape=x.shape[:-1], n_classes=vocab.n_classes,
                             device=x_local.device, row_classes=max(vocab.size, 1), vocab_start=vocab.start,
                             teacher_grad=teacher_grad)
    combine = functools.partial(combine_stats, vocab=vocab)
    return replicate_result(operators.loss_rows(x_local, w, b, tokens, spec, combine, second=local2), vocab.mesh)


_TOKEN_ARGS = ("mask", "weights", "num_label_tokens")
