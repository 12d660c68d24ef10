"""What a ``functional_ce`` operator allocates inside itself: its chunk workspace, in bytes.

Each operator (:mod:`functional_ce.operators`) runs a loop over chunks of rows: the chunk's
logits ``[rows, V]``, their gradient, fp32 accumulators of the weight's gradient. A dispatch mode
that counts the tensors a step allocates (``ac_policies.estimate``, ``measure_step``) sees the
operator as one call and its outputs, not these buffers. :func:`workspace_bytes` reports them: it
runs the operator's own loop on fake tensors of the call's shapes (nothing is computed or
allocated) and returns the most bytes its temporaries held at once, the operator's inputs and
outputs excluded, at the chunk size in force for that call (it is in the call's spec). The rows
that take part (labels not ignored) are read from real labels; on fake labels every row does.

The loop is run with the chunk maths eager, as it runs under a dispatch mode; a compiled chunk
graph fuses pointwise steps and holds no more than this.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from .inputs import KNOWN_ROWS, ValidRows
from .operators import IMPLEMENTATIONS
from .spec import decode

__all__ = ["workspace_bytes", "is_operator"]

NAMESPACE = "functional_ce"


def is_operator(func: Any) -> bool:
    """Whether ``func`` (an ``OpOverload``) is one of this package's operators."""
    return getattr(func, "namespace", None) == NAMESPACE and f"{NAMESPACE}::{func._opname}" in IMPLEMENTATIONS


class _PeakOfTemporaries(TorchDispatchMode):
    """The most bytes alive at once among storages made while it is active, except ``excluded``."""

    def __init__(self, excluded: set[int]) -> None:
        super().__init__()
        self.excluded = excluded
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.excluded and (key not in self.live or self.live[key][0].expired()):
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _fake_mode(args: Any) -> Optional[FakeTensorMode]:
    for t in tree_leaves(args):
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return None


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device.type, value.is_contiguous())
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


_SEEN: dict[Any, int] = {}


def workspace_bytes(func: Any, args: tuple, kwargs: Optional[dict] = None) -> int:
    """Bytes the operator ``func`` (``torch.ops.functional_ce.<name>.default``) allocates inside
    itself at its peak for these arguments (real or fake tensors; they are not touched), beyond its
    inputs and the outputs it returns. 0 for anything that is not one of this package's operators.
    Remembered per operator, shapes, dtypes, spec and number of rows taking part.
    """
    if not is_operator(func):
        return 0
    impl = IMPLEMENTATIONS[f"{NAMESPACE}::{func._opname}"]
    kwargs = kwargs or {}
    named = dict(zip(inspect.signature(impl).parameters, args), **kwargs)
    labels, spec = named.get("labels"), named.get("spec")
    valid = None
    if isinstance(labels, torch.Tensor) and isinstance(spec, str) and not isinstance(labels, FakeTensor):
        valid = (labels != decode(spec).ignore_index).nonzero().squeeze(1)
    key = (str(func), valid if valid is None else valid.numel(),
           tuple(_describe(a) for a in tree_leaves((args, kwargs))))
    if key not in _SEEN:
        _SEEN[key] = _run_on_fakes(impl, args, kwargs, valid)
    return _SEEN[key]


def _run_on_fakes(impl: Any, args: tuple, kwargs: dict, valid: Optional[torch.Tensor]) -> int:
    """The peak of ``impl``'s temporaries on fake copies of the arguments; ``valid``: the indices of
    the rows taking part, read from real labels (None: every row, as on fake labels)."""
    mode = _fake_mode((args, kwargs)) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_args, fake_kwargs = tree_map(
            lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t,
            (args, kwargs))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((fake_args, fake_kwargs)) if isinstance(t, torch.Tensor)}
        n = next((t.shape[0] for t in tree_leaves(fake_args) if isinstance(t, torch.Tensor)), 0)
        tracker = _PeakOfTemporaries(inputs)
        with tracker:
            # the index of the rows taking part is made where the loop makes it, as the real one is
            every = valid is None or valid.numel() == n
            token = KNOWN_ROWS.set(lambda: ValidRows(n, None) if every else
                                   ValidRows(n, torch.empty(valid.shape, dtype=valid.dtype)))
            try:
                out = impl(*fake_args, **fake_kwargs)
            finally:
                KNOWN_ROWS.reset(token)
        outputs = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    # the outputs are counted where the operator returns them, by the caller
    return max(0, tracker.peak - sum(outputs.values()))
