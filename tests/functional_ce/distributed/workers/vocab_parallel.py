"""What each process of a :class:`bench.harness.dist_pool.DistPool` runs for the vocabulary-parallel tests.

Every task rebuilds the seeded full inputs (identical on every rank), shards them with
``distribute_tensor``, runs the loss and backward with a seeded upstream gradient, counts the
bytes handed to collectives in forward and in backward separately, and returns plain tensors
(the loss, the gathered gradients) for the parent process to compare with the fp64 reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_ce
from bench.harness.comm_bytes import CommBytes
from tests.functional_ce.ce_cases import make_case
from tests.functional_ce.linear_cases import make_linear_case, reference_linear
from tests.support.reference import reference_cross_entropy


@dataclasses.dataclass
class RankResult:
    """One process's view of one loss call."""

    loss: torch.Tensor  # the local value of the Replicate loss
    grads: list[Optional[torch.Tensor]]  # full (gathered) gradients of the float inputs
    forward_bytes: int
    backward_bytes: int
    by_op: dict[str, int]
    grad_placements: list[Any] = dataclasses.field(default_factory=list)
    loss_placements: tuple = ()
    grad_is_logits_storage: Optional[bool] = None  # logits.grad's local tensor is the logits' storage
    grad_reaching_logits_is_storage: Optional[bool] = None  # the same for the gradient autograd hands the leaf


def placements(ndim: int, mesh_dim: Optional[int], shard: Any) -> list[Any]:
    """``shard`` on ``mesh_dim`` (None: nowhere), ``Replicate()`` on every other mesh dim."""
    out: list[Any] = [Replicate()] * ndim
    if mesh_dim is not None:
        out[mesh_dim] = shard
    return out


def _upstream(shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _backward(out: DTensor, upstream_seed: int, inputs: list[torch.Tensor]) -> tuple[list, CommBytes]:
    up = _upstream(out.shape, upstream_seed).to(out.dtype)
    weighted = (out.to_local() * up).sum()
    with CommBytes() as comm:
        weighted.backward()
    return [t.grad for t in inputs], comm


def _compiled(fn: Callable[..., Any], compile: Optional[str]) -> Callable[..., Any]:
    """``fn``, or ``fn`` compiled whole (``fullgraph=True``) with the ``compile`` backend."""
    return fn if compile is None else torch.compile(fn, backend=compile, fullgraph=True)


def _counted(compile: Optional[str]) -> CommBytes:
    """A byte counter for an eager call; under torch.compile (which refuses a user dispatch
    mode while it traces) one that stays empty."""
    return CommBytes() if compile is None else _NotCounted()


class _NotCounted(CommBytes):
    def __enter__(self):  # noqa: D105
        return self

    def __exit__(self, *exc):  # noqa: D105
        return False


def _token_args(mesh, labels: torch.Tensor, kwargs: dict[str, Any], as_dtensor: bool) -> tuple[Any, dict[str, Any]]:
    """Labels and the loss keywords as given, or with labels, mask and weights as DTensors
    ``Replicate()`` on every mesh dim (``as_dtensor``)."""
    if not as_dtensor:
        return labels, kwargs
    as_dt = lambda t: distribute_tensor(t, mesh, [Replicate()] * mesh.ndim)  # noqa: E731
    kwargs = dict(kwargs)
    for key in ("mask", "weights"):
        if isinstance(kwargs.get(key), torch.Tensor):
            kwargs[key] = as_dt(kwargs[key])
    return as_dt(labels), kwargs


def logits_case(mesh, mesh_dim, seed, batch_shape, v, dtype, kwargs, inplace=False, compile=None,
                token_args_as_dtensor=False, upstream_seed=1, compile_chunks=None, chunk_size="auto"):
    """The logits form on ``mesh`` with the vocabulary on ``mesh_dim``; ``token_args_as_dtensor``
    passes labels, mask and weights as ``Replicate()`` DTensors."""
    if mesh is None:
        return None
    case = make_case(seed, batch_shape, v, dtype, **dict(kwargs))
    full = case.logits.detach()
    logits = distribute_tensor(full, mesh, placements(mesh.ndim, mesh_dim, Shard(full.dim() - 1)))
    logits.requires_grad_()
    local_storage = logits.to_local().data_ptr()
    reaching: list[bool] = []
    logits.register_hook(lambda g: reaching.append(g.to_local().data_ptr() == local_storage))
    labels, kwargs = _token_args(mesh, case.labels, case.kwargs, token_args_as_dtensor)
    fn = _compiled(functional_ce.cross_entropy, compile)
    with _counted(compile) as fwd:
        out = fn(logits, labels, **kwargs, inplace_grad=inplace, compile_chunks=compile_chunks,
                 chunk_size=chunk_size)
    (grad,), bwd = _backward(out, upstream_seed, [logits])
    result = RankResult(
        out.to_local().detach().clone(), [grad.full_tensor()], fwd.bytes, bwd.bytes, dict(fwd.by_op),
        [tuple(grad.placements)], tuple(out.placements),
    )
    result.grad_is_logits_storage = grad.to_local().data_ptr() == local_storage
    result.grad_reaching_logits_is_storage = reaching == [True]
    return result


def linear_case(mesh, mesh_dim, seed, batch_shape, h, v, dtype, kwargs, bias=False, token_dim=None,
                compile=None, upstream_seed=1, compile_chunks=None, chunk_size="auto", token_args_as_dtensor=False):
    """The hidden-state form: weight (and bias) ``Shard(0)`` on ``mesh_dim``; hidden ``Replicate()``,
    or ``Shard(token_dim)`` on ``mesh_dim`` (sequence parallel) when ``token_dim`` is given."""
    if mesh is None:
        return None
    case = make_linear_case(seed, batch_shape, h, v, dtype, bias=bias, **dict(kwargs))
    weight = distribute_tensor(case.weight, mesh, placements(mesh.ndim, mesh_dim, Shard(0))).requires_grad_()
    hidden_shard = Replicate() if token_dim is None else Shard(token_dim)
    hidden = distribute_tensor(case.hidden, mesh, placements(mesh.ndim, mesh_dim, hidden_shard)).requires_grad_()
    b = None
    if case.bias is not None:
        b = distribute_tensor(case.bias, mesh, placements(mesh.ndim, mesh_dim, Shard(0))).requires_grad_()
    labels, kwargs = _token_args(mesh, case.labels, case.kwargs, token_args_as_dtensor)
    fn = _compiled(functional_ce.linear_cross_entropy, compile)
    with _counted(compile) as fwd:
        out = fn(hidden, weight, labels, bias=b, **kwargs, compile_chunks=compile_chunks,
                 chunk_size=chunk_size)
    leaves = [hidden, weight] + ([b] if b is not None else [])
    grads, bwd = _backward(out, upstream_seed, leaves)
    return RankResult(
        out.to_local().detach().clone(), [g.full_tensor() for g in grads], fwd.bytes, bwd.bytes, dict(fwd.by_op),
        [tuple(g.placements) for g in grads], tuple(out.placements),
    )


def many(mesh, task, cases):
    """Run ``task(mesh, *case)`` for each case in one round trip (None outside the mesh)."""
    if mesh is None:
        return None
    return [task(mesh, *case) for case in cases]


def many_tasks(mesh, calls):
    """Run each ``(task, args)`` of ``calls`` as ``task(mesh, *args)`` in one round trip."""
    if mesh is None:
        return None
    return [task(mesh, *args) for task, args in calls]


def raises(mesh, name):
    """The error message the unsupported layout ``name`` raises (None if it raises nothing)."""
    if mesh is None:
        return None
    try:
        _layout_error(mesh, name)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def degenerate_logits_case(mesh, labels_kind):
    """V = 3 over 4 processes (shards of 1, 1, 1, 0 classes); labels all class 0 (only the
    first process holds a target) or all ignored. Returns the loss, the gathered gradient and
    the fp64 single-process reference of both."""
    if mesh is None:
        return None
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 3, generator=g)
    labels = torch.zeros(5, dtype=torch.long) if labels_kind == "first-class-only" else torch.full((5,), -100)
    logits = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
    out = functional_ce.cross_entropy(logits, labels, label_smoothing=0.1)
    out.to_local().backward()
    x = full.double().requires_grad_()
    ref = reference_cross_entropy(x, labels, label_smoothing=0.1)
    ref.backward()
    return {"loss": out.to_local().detach().double(), "grads": [logits.grad.full_tensor().double()],
            "reference": (ref.detach(), [x.grad])}


def degenerate_linear_case(mesh, labels_kind):
    """:func:`degenerate_logits_case` for the hidden-state form, with a bias."""
    if mesh is None:
        return None
    g = torch.Generator().manual_seed(4)
    h_full, w_full, b_full = torch.randn(5, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    labels = torch.zeros(5, dtype=torch.long) if labels_kind == "first-class-only" else torch.full((5,), -100)
    hidden = distribute_tensor(h_full, mesh, [Replicate()]).requires_grad_()
    weight = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()
    bias = distribute_tensor(b_full, mesh, [Shard(0)]).requires_grad_()
    out = functional_ce.linear_cross_entropy(hidden, weight, labels, bias=bias, z_loss=1e-2)
    out.to_local().backward()
    leaves = [t.double().requires_grad_() for t in (h_full, w_full, b_full)]
    ref = reference_linear(leaves[0], leaves[1], labels, bias=leaves[2], z_loss=1e-2)
    ref.backward()
    grads = [t.grad.full_tensor().double() for t in (hidden, weight, bias)]
    return {"loss": out.to_local().detach().double(), "grads": grads,
            "reference": (ref.detach(), [t.grad for t in leaves])}


def traced_allocations(mesh, form, n, h, v, chunk_size):
    """Every tensor the loss allocates on this process (forward and backward), recorded by
    :class:`tests.support.alloc_trace.AllocationTrace` as ``(op, shape, dtype)``, and this process's
    number of classes. Hidden states are sequence parallel (sharded over tokens)."""
    from tests.support.alloc_trace import AllocationTrace

    if mesh is None:
        return None
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, v, (n,), generator=g)
    logits = distribute_tensor(torch.randn(n, v, generator=g), mesh, [Shard(1)]).requires_grad_()
    hidden = distribute_tensor(torch.randn(n, h, generator=g), mesh, [Shard(0)]).requires_grad_()
    weight = distribute_tensor(torch.randn(v, h, generator=g), mesh, [Shard(0)]).requires_grad_()
    local_v = logits.to_local().shape[1]
    with AllocationTrace() as trace:
        if form == "logits":
            loss = functional_ce.cross_entropy(logits, labels, chunk_size=chunk_size, label_smoothing=0.1)
        else:
            loss = functional_ce.linear_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
        loss.to_local().backward()
    return {"records": trace.records, "local_v": local_v}


def fsdp_case(mesh, fsdp_dims, seed, batch_shape, h, v, dtype, kwargs, bias, chunk_size="auto"):
    """FSDP2's layout: the LM head ``Shard(0)`` on the mesh dims in ``fsdp_dims`` (``Replicate()``
    on the others, as HSDP), hidden states and labels plain and different on every process.

    Returns this process's loss and gradients, the weight's gradient gathered, and the fp64
    single-process reference on this process's own data (its weight gradient is this process's
    share of the sum)."""
    import torch.distributed as dist

    if mesh is None:
        return None
    shared = make_linear_case(seed, batch_shape, h, v, dtype, bias=bias)
    own = make_linear_case(seed + 1 + dist.get_rank(), batch_shape, h, v, dtype, **dict(kwargs))
    layout = [Shard(0) if i in fsdp_dims else Replicate() for i in range(mesh.ndim)]
    weight = distribute_tensor(shared.weight, mesh, layout).requires_grad_()
    b = distribute_tensor(shared.bias, mesh, layout).requires_grad_() if bias else None
    hidden = own.hidden.detach().clone().requires_grad_()
    out = functional_ce.linear_cross_entropy(hidden, weight, own.labels, bias=b, **own.kwargs, chunk_size=chunk_size)
    up = _upstream(out.shape, 1 + dist.get_rank()).to(out.dtype)
    with CommBytes() as bwd:
        (out * up).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (own.hidden, shared.weight, shared.bias) if t is not None]
    ref = reference_linear(leaves[0], leaves[1], own.labels, bias=leaves[2] if bias else None, **own.kwargs)
    (ref * up.double()).sum().backward()
    grads = [hidden.grad, weight.grad.full_tensor()] + ([b.grad.full_tensor()] if bias else [])
    return {
        "loss": out.detach(), "is_plain": not isinstance(out, DTensor), "grads": grads,
        "grad_placements": [tuple(weight.grad.placements)] + ([tuple(b.grad.placements)] if bias else []),
        "reference": (ref.detach(), [t.grad for t in leaves]), "backward_by_op": dict(bwd.by_op),
    }


def _dt(mesh, t, *placements):
    return distribute_tensor(t, mesh, list(placements))


def _layout_error(mesh, name):
    """Build and call the loss with the unsupported layout ``name`` (a key of LAYOUT_ERRORS)."""
    x, y = torch.randn(6, 10), torch.randint(0, 10, (6,))
    hidden, weight, bias = torch.randn(6, 4), torch.randn(10, 4), torch.randn(10)
    ce, lce = functional_ce.cross_entropy, functional_ce.linear_cross_entropy
    if name == "vocabulary on two mesh dims":
        ce(_dt(mesh, x, Shard(1), Shard(1)), y)
    elif name == "partial logits":
        ce(DTensor.from_local(x, mesh, [Partial(), Shard(1)], run_check=False), y)
    elif name == "token-sharded logits":
        ce(_dt(mesh, x, Shard(0), Replicate()), y)
    elif name == "labels sharded over tokens":
        ce(_dt(mesh, x, Shard(1), Replicate()), _dt(mesh, y, Shard(0), Replicate()))
    elif name == "plain weight, DTensor hidden":
        lce(_dt(mesh, hidden, Replicate(), Replicate()), weight, y)
    elif name == "FSDP2 weight sharded on its features":
        lce(hidden, _dt(mesh, weight, Shard(1), Replicate()), y)
    elif name == "FSDP2 weight with a Partial placement":
        lce(hidden, DTensor.from_local(weight, mesh, [Partial(), Replicate()], run_check=False), y)
    elif name == "row-parallel weight":
        lce(_dt(mesh, hidden, Replicate(), Replicate()), _dt(mesh, weight, Shard(1), Replicate()), y)
    elif name == "hidden sharded over its features":
        lce(_dt(mesh, hidden, Shard(1), Replicate()), _dt(mesh, weight, Shard(0), Replicate()), y)
    elif name == "hidden token-sharded off the vocabulary dim":
        lce(_dt(mesh, hidden, Replicate(), Shard(0)), _dt(mesh, weight, Shard(0), Replicate()), y)
    elif name == "bias not sharded like the weight":
        lce(_dt(mesh, hidden, Replicate(), Replicate()), _dt(mesh, weight, Shard(0), Replicate()), y,
            bias=_dt(mesh, bias, Replicate(), Replicate()))
    else:
        raise KeyError(name)


#: Unsupported layout -> a phrase its ValueError contains (besides the supported layouts).
LAYOUT_ERRORS = {
    "vocabulary on two mesh dims": "sharded on mesh dims [0, 1]",
    "partial logits": "Partial(sum) on mesh dim 0 is not supported",
    "token-sharded logits": "Shard(dim=0) on mesh dim 0 is not supported",
    "labels sharded over tokens": "labels is a DTensor with placements (Shard(dim=0), Replicate())",
    "plain weight, DTensor hidden": "hidden is a DTensor but weight is a plain tensor",
    "FSDP2 weight sharded on its features": "Shard(dim=1) on mesh dim 0 is not supported. Supported: each mesh dim",
    "FSDP2 weight with a Partial placement": "Partial(sum) on mesh dim 0 is not supported. Supported: each mesh dim",
    "row-parallel weight": "Shard(dim=1) on mesh dim 0 is not supported",
    "hidden sharded over its features": "Shard(dim=1) on mesh dim 0 is not supported",
    "hidden token-sharded off the vocabulary dim": "Shard(dim=0) on mesh dim 1 is not supported",
    "bias not sharded like the weight": "bias must be sharded like the weight",
}
