"""What a ``functional_ce`` operator allocates inside itself: its chunk workspace, in bytes.

Each operator (:mod:`functional_ce.operators`) runs a loop over chunks of rows: the chunk's
logits ``[rows, V]``, their gradient, fp32 accumulators of the weight's gradient. A dispatch mode
that counts the tensors a step allocates (``ac_policies.estimate``, ``measure_step``) sees the
operator as one call and its outputs, not these buffers. :func:`workspace_bytes` reports them: it
runs the operator's own loop on fake tensors of the call's shapes (nothing is computed or
allocated) and returns the most bytes its temporaries held at once, the operator's inputs and
outputs excluded, at the chunk size in force for that call (it is in the call's spec). The rows
that take part (labels not ignored) are read from real labels; on fake labels every row does.

The loop is run with the chunk maths eager (it runs so under a dispatch mode), and the bytes
counted are those of the path the operator takes in training: with compiled chunk graphs (the
default, ``FUNCTIONAL_CE_COMPILE``), a chunk holds its matmuls' outputs and what it returns (its
pointwise steps are fused); with eager chunks, every temporary.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from . import driver
from .compiled_chunks import compile_by_default
from .inputs import KNOWN_ROWS, ValidRows
from .operators import IMPLEMENTATIONS
from .spec import decode

__all__ = ["workspace_bytes", "is_operator"]

NAMESPACE = "functional_ce"


def is_operator(func: Any) -> bool:
    """Whether ``func`` (an ``OpOverload``) is one of this package's operators."""
    return getattr(func, "namespace", None) == NAMESPACE and f"{NAMESPACE}::{func._opname}" in IMPLEMENTATIONS


#: What a compiled chunk graph allocates: its matmuls' outputs (external kernels) and what it
#: returns; its pointwise steps and reductions are fused into those or into small row buffers.
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})


class _PeakOfTemporaries(TorchDispatchMode):
    """The most bytes alive at once among storages made while it is active, except ``excluded``.

    With ``fused`` (the chunk maths compiled), inside a chunk (``in_chunk``) only matmul outputs
    are counted, and the chunk's returned tensors when it returns (:meth:`returned`)."""

    def __init__(self, excluded: set[int], fused: bool = False) -> None:
        super().__init__()
        self.excluded = excluded
        self.fused = fused
        self.in_chunk = False
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def _add(self, tensors: Any) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.excluded and (key not in self.live or self.live[key][0].expired()):
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))

    def returned(self, out: Any) -> None:
        self._add(out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (self.fused and self.in_chunk) or getattr(func, "_opname", "") in _MATMULS:
            self._add(out)
        return out


@contextlib.contextmanager
def _chunks_seen_by(tracker: _PeakOfTemporaries) -> Iterator[None]:
    """Route the driver's chunk calls through ``tracker`` (fused chunks: see :class:`_PeakOfTemporaries`)."""
    original = driver.run_chunk

    def run_chunk(*args: Any, **kwargs: Any) -> Any:
        tracker.in_chunk = True
        try:
            out = original(*args, **kwargs)
        finally:
            tracker.in_chunk = False
        tracker.returned(out)
        return out

    driver.run_chunk = run_chunk
    try:
        yield
    finally:
        driver.run_chunk = original


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


#: The operators' parameters whose first dimension is the token rows.
ROW_ARGUMENTS = frozenset({"x", "x2", "hidden", "hidden2", "labels", "prior", "stats", "coef", "grad_rows", "saved",
                           "logits", "logits2", "out", "out2"})


def workspace_bytes(func: Any, args: tuple, kwargs: Optional[dict] = None) -> int:
    """Bytes the operator ``func`` (``torch.ops.functional_ce.<name>.default``) allocates inside
    itself at its peak for these arguments (real or fake tensors; they are not touched), beyond its
    inputs and the outputs it returns. 0 for anything that is not one of this package's operators.

    Past four chunks of rows the loop is run on two and four chunks' worth and the bytes
    extrapolated linearly in the rows (each chunk's buffers are the same size; what grows with the
    rows, such as the gathered valid rows, grows linearly). Remembered per operator, shapes,
    dtypes, spec, number of rows taking part and ``FUNCTIONAL_CE_COMPILE``.
    """
    if not is_operator(func):
        return 0
    impl = IMPLEMENTATIONS[f"{NAMESPACE}::{func._opname}"]
    kwargs = kwargs or {}
    names = list(inspect.signature(impl).parameters)
    named = dict(zip(names, args), **kwargs)
    labels, spec = named.get("labels"), named.get("spec")
    n_valid = None
    if isinstance(labels, torch.Tensor) and isinstance(spec, str) and not isinstance(labels, FakeTensor):
        n_valid = int((labels != decode(spec).ignore_index).sum())
    key = (str(func), n_valid, compile_by_default(), tuple(_describe(a) for a in tree_leaves((args, kwargs))))
    if key not in _SEEN:
        _SEEN[key] = _extrapolated(impl, names, named, n_valid)
    return _SEEN[key]


def _rows(named: dict) -> int:
    return next((v.shape[0] for k, v in named.items() if k in ROW_ARGUMENTS and isinstance(v, torch.Tensor)), 0)


def _extrapolated(impl: Any, names: list[str], named: dict, n_valid: Optional[int]) -> int:
    n = _rows(named)
    spec = named.get("spec")
    chunk = decode(spec).rows_in(n) if isinstance(spec, str) and n else n
    if n <= 4 * chunk:
        return _run_on_fakes(impl, named, n_valid)
    sizes = (2 * chunk, 4 * chunk)
    found = []
    for rows in sizes:
        cut = {k: v[:rows] if k in ROW_ARGUMENTS and isinstance(v, torch.Tensor) else v for k, v in named.items()}
        found.append(_run_on_fakes(impl, cut, None if n_valid is None else round(n_valid * rows / n)))
    slope = (found[1] - found[0]) / (sizes[1] - sizes[0])
    return max(0, round(found[1] + slope * (n - sizes[1])))


def _run_on_fakes(impl: Any, named: dict, n_valid: Optional[int]) -> int:
    """The peak of ``impl``'s temporaries on fake copies of the arguments (by name); ``n_valid``:
    how many rows take part, read from real labels (None: every row, as on fake labels)."""
    mode = _fake_mode(named) or FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
                        else t, named)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves(fake) if isinstance(t, torch.Tensor)}
        n = _rows(fake)
        spec = fake.get("spec")
        compiled = decode(spec).compile_chunks if isinstance(spec, str) else None
        tracker = _PeakOfTemporaries(inputs, fused=compile_by_default() if compiled is None else compiled)
        with tracker, _chunks_seen_by(tracker):
            # the index of the rows taking part is made where the loop makes it, as the real one is
            every = n_valid is None or n_valid == n
            token = KNOWN_ROWS.set(lambda: ValidRows(n, None) if every else
                                   ValidRows(n, torch.empty(n_valid, dtype=torch.int64)))
            try:
                out = impl(**fake)
            finally:
                KNOWN_ROWS.reset(token)
        outputs = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    # the outputs are counted where the operator returns them, by the caller
    return max(0, tracker.peak - sum(outputs.values()))
