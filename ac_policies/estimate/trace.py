"""One training step traced op by op: the bytes alive after every op, the phase and the modules
running, on fake tensors (the estimate) or real ones (the measurement it is checked against).

The accounting is :class:`ac_policies.accounting.LiveBytes`'s: every storage an op produces is counted
once (by storage identity, not per view) from the op that makes it until nothing references it
(weak references). Storages alive before the step (parameters, buffers, optimizer state) are the
baseline, counted once by storage. Bytes are ``nbytes`` of each storage, or as ``size_of`` rounds
them (:func:`cuda_block_bytes`).
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_leaves, tree_map

from functional_ce.workspace import is_operator, workspace_bytes

from ..accounting import LiveBytes, local_shard, storage_key

__all__ = ["PHASES", "StepTrace", "cuda_block_bytes", "make_optimizer", "trace_step", "unique_bytes"]

PHASES = ("forward", "backward", "optimizer")
#: The CUDA caching allocator rounds every request up to a multiple of this (``round_size``).
CUDA_BLOCK = 512


def cuda_block_bytes(nbytes: int) -> int:
    """``nbytes`` as the CUDA caching allocator rounds one request: up to a multiple of 512 bytes
    (0 stays 0). Segments, caching and fragmentation are not modelled."""
    return 0 if nbytes <= 0 else -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


def unique_bytes(tensors: Iterable[Optional[torch.Tensor]], size_of: Callable[[int], int] = int) -> int:
    """Bytes of the distinct storages of ``tensors`` (each storage once; None skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            t = local_shard(t)
            seen.setdefault(storage_key(t), size_of(t.untyped_storage().nbytes()))
    return sum(seen.values())


def _has_graph(t: torch.Tensor) -> bool:
    """Whether autograd reaches ``t`` when it requires grad: False for a view taken, inside a
    custom ``autograd.Function``'s forward, of a tensor that requires grad (DeepSpeed's
    ``TiledMLP`` slices its input that way): it requires grad with no graph behind it."""
    if not t.requires_grad or t.grad_fn is not None or not t._is_view():
        return True
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0] is not None


class _ModuleTracker(ModTracker):
    """``ModTracker`` that leaves out of its backward hooks the tensors autograd does not reach
    (:func:`_has_graph`): its hooks assert on them, and their module runs outside the step's graph.
    A backward run inside forward (DeepSpeed's ``TiledFusedLogitsLoss`` does) pops the modules
    running around it early; their own exit then finds them gone, which ModTracker raises on and
    this tracker lets pass (the names only label where a peak is)."""

    @staticmethod
    def _reachable(tree: Any) -> Any:
        # the common call, a tensor or a tuple of them that autograd reaches, costs no tree walk
        if isinstance(tree, torch.Tensor):
            return tree if _has_graph(tree) else tree.detach()
        if isinstance(tree, tuple) and all(isinstance(a, torch.Tensor) and _has_graph(a) for a in tree):
            return tree
        return tree_map(lambda a: a.detach() if isinstance(a, torch.Tensor) and not _has_graph(a) else a, tree)

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        super()._fw_pre_hook(mod, self._reachable(input))

    def _fw_post_hook(self, mod: nn.Module, input: Any, output: Any) -> None:
        try:
            super()._fw_post_hook(mod, input, self._reachable(output))
        except RuntimeError as exc:
            if "hierarchy tracking is wrong" not in str(exc):
                raise


class StepTrace(LiveBytes):
    """:class:`LiveBytes` that keeps, per op: live op-output bytes (``totals``), the phase index
    (``phases``) and the fully qualified names of the modules running (``modules``, from
    ``ModTracker``, ``""`` for the root), and when each storage was first counted (``born``).

    A loss operator of ``functional_ce`` adds, at its own op, the chunk workspace it reports
    (:func:`functional_ce.workspace.workspace_bytes`): the buffers it allocates inside itself,
    which no dispatch mode above it sees; ``workspace`` is the largest.

    ``extra`` (real runs only) adds bytes no op allocates, read after every op (storages resized
    in place, such as FSDP2's unsharded parameters).
    """

    def __init__(self, owned: set, size_of: Callable[[int], int], tracker: ModTracker,
                 extra: Optional[Callable[[], int]] = None) -> None:
        super().__init__(owned, None, size_of)
        self.tracker, self.extra = tracker, extra
        self.phase = 0
        self.totals: list[int] = []
        self.phases: list[int] = []
        self.modules: list[frozenset] = []
        self.born: dict[int, tuple[Any, int]] = {}
        self.workspace = 0  # the largest chunk workspace of a loss operator in the step
        self._last: frozenset = frozenset()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # what a loss operator allocates inside itself, alive while it runs (it reports it)
        inside = (self.size_of or int)(workspace_bytes(func, args, kwargs or {})) if is_operator(func) else 0
        self.workspace = max(self.workspace, inside)
        if not self._record(out) and self.totals and self.extra is None and not inside:
            # nothing new: the total can only have fallen, and no peak is missed by keeping the
            # last one (an upper bound until the next allocation); saves a scan per view op
            self._append(self.totals[-1])
            return out
        index = len(self.totals)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = storage_key(local_shard(t))
                entry = self.refs.get(key)
                if entry is not None and self.born.get(key, (None,))[0] is not entry[0]:
                    self.born[key] = (entry[0], index)
        total = self.total() + (self.extra() if self.extra else 0) + inside
        self.peak = max(self.peak, total)
        self._append(total)
        return out

    def _append(self, total: int) -> None:
        self.totals.append(total)
        self.phases.append(self.phase)
        parents = self.tracker.parents
        if parents != self._last:
            self._last = frozenset(parents)
        self.modules.append(self._last)


def make_optimizer(params: list[nn.Parameter], optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The optimizer a step runs: ``"adamw"`` (``torch.optim.AdamW``, foreach: the default on
    CUDA, with its parameter-sized temporaries), ``"adamw_fused"``, ``"sgd"`` (momentum 0.9:
    one buffer per parameter), None (no optimizer step), or a callable ``params -> Optimizer``.
    Learning rate 0: the real step used for measurement leaves the parameters as they were."""
    if optimizer is None:
        return None
    if callable(optimizer):
        return optimizer(params)
    name = str(optimizer).strip().lower().replace("-", "_")
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.0, foreach=True)
    if name == "adamw_fused":
        return torch.optim.AdamW(params, lr=0.0, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.0, momentum=0.9, foreach=True)
    raise ValueError(f"optimizer must be 'adamw', 'adamw_fused', 'sgd', None or a callable params -> Optimizer, "
                     f"got {optimizer!r}")


@dataclasses.dataclass
class TracedStep:
    """What :func:`trace_step` saw. Bytes as counted (``size_of``); ``trace`` holds the per-op record."""

    params: int
    buffers: int
    grads: int
    optimizer: int
    activations: int
    trace: StepTrace
    grad_keys: dict[int, str]  # storage key of each parameter gradient -> the parameter's name
    state_of: dict[str, int]  # parameter name -> optimizer state bytes shaped like it
    root: str  # the model's class name, which ModTracker's names start with


def _state_tensors(opt: Optional[torch.optim.Optimizer]) -> list[torch.Tensor]:
    if opt is None:
        return []
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def trace_step(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], optimizer: Any, *,
               size_of: Callable[[int], int] = int,
               resized: Optional[Callable[[], list[torch.Tensor]]] = None) -> TracedStep:
    """Run one steady-state training step of ``model`` and trace its bytes.

    The optimizer's state is made first (one optimizer step on zero gradients, learning rate 0), as
    it is alive in every step after the first; gradients are None when forward starts (as after
    ``zero_grad()``). Then, traced: ``loss = step(model)`` (forward), ``loss.backward()``,
    ``optimizer.step()``. ``resized()`` (real runs) gives tensors whose storages are resized in
    place (FSDP2's all-gather outputs): counted at their current size after every op, never as
    op outputs. On real tensors the parameters end as they were (learning rate 0) and
    their gradients are set to None again.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = make_optimizer([p for _, p in named], optimizer)
    if opt is not None:
        for _, p in named:
            p.grad = torch.zeros_like(p)
        opt.step()
    for _, p in named:
        p.grad = None
    params = [p for p in model.parameters()]
    buffers = [b for b in model.buffers()]
    states = _state_tensors(opt)
    owned = {storage_key(local_shard(t)) for t in [*params, *buffers, *states, *(resized() if resized else [])]}
    state_of = {}
    for n, p in named:
        st = opt.state.get(p, {}) if opt is not None else {}
        state_of[n] = sum(size_of(local_shard(v).untyped_storage().nbytes()) for v in st.values()
                          if isinstance(v, torch.Tensor) and v.shape == p.shape)
    tracker = _ModuleTracker()
    extra = (lambda: unique_bytes(resized(), size_of)) if resized is not None else None
    trace = StepTrace(owned, size_of, tracker, extra)
    root = type(model).__name__
    gc.freeze()
    quiet = warnings.catch_warnings()
    quiet.__enter__()
    # ModTracker warns when a module runs inside itself (checkpoint's recompute re-enters blocks)
    warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
    try:
        with tracker, trace:
            loss = step(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"step(model) must return the loss as a one-element tensor, got {type(loss).__name__}"
                            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        gc.collect()
        loss_key = storage_key(loss)
        activations = sum(n for key, (ref, n) in trace.refs.items() if not ref.expired() and key != loss_key)
        trace.phase = 1
        # a scalar built from a Python number: on fake tensors it keeps its value, so code that
        # reads the incoming gradient (DeepSpeed's TiledFusedLogitsLoss checks it is 1) runs
        seed = torch.tensor(1.0, dtype=loss.dtype, device=loss.device).reshape(loss.shape)
        with tracker, trace:
            loss.backward(seed)
            del loss, seed
        grads = [p.grad for _, p in named]
        grad_keys = {storage_key(local_shard(p.grad)): n for n, p in named if p.grad is not None}
        grad_bytes = unique_bytes(grads, size_of)
        del grads
        trace.phase = 2
        if opt is not None:
            with tracker, trace:
                opt.step()
    finally:
        quiet.__exit__(None, None, None)
        gc.unfreeze()
        for _, p in named:
            p.grad = None
    return TracedStep(
        params=unique_bytes(params, size_of), buffers=unique_bytes(buffers, size_of), grads=grad_bytes,
        optimizer=unique_bytes(states, size_of), activations=activations, trace=trace, grad_keys=grad_keys,
        state_of=state_of, root=root,
    )
