"""The loss spec: every option of a call in one frozen value, and the checks of its keywords.

:class:`LossSpec` declares each public keyword option once, as a field with its default, its
check and the losses and forms that take it; :func:`check_keywords` and
:func:`functional_ce.inputs.make_spec` validate a call's keywords against it (every loss, its
``nn.Module`` form and its DTensor form go through them). The spec travels to the custom operators
as one string (:meth:`LossSpec.encode`) and back (:func:`decode`); compiled chunk graphs
specialise on its maths fields (:meth:`LossSpec.maths`).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import numbers
import warnings
from typing import Any, Callable, Literal, Optional, Union

import torch

ChunkSize = Union[int, Literal["auto"], None]
Count = Union[int, float, torch.Tensor, None]

#: Bytes that one fp32 chunk of logits may take when ``chunk_size="auto"`` (logits form).
AUTO_CHUNK_BYTES = 256 * 1024 * 1024
#: ``chunk_size="auto"`` of the hidden-state form (CPU): chunks of this many rows, where the
#: chunk's matmuls reach full rate (bench/RESULTS.md, ``lce``), fewer only where one fp32
#: ``[rows, V]`` chunk would pass the byte cap (large vocabularies).
LINEAR_AUTO_CHUNK_ROWS = 512
LINEAR_AUTO_CHUNK_BYTES = 64 * 1024 * 1024
#: The same on CUDA, where each chunk adds its weight-gradient partial into the ``[V, H]`` fp32
#: accumulator (hidden behind the matmul only from about 700 rows on an H100/H200) and a GPU
#: needs large matmuls to fill its multiprocessors: the knee of the GPU chunk sweep in
#: bench/RESULTS.md, with one fp32 chunk at most 1 GiB (2048 rows of a 128K vocabulary).
LINEAR_AUTO_CHUNK_ROWS_CUDA = 2048
LINEAR_AUTO_CHUNK_BYTES_CUDA = 1024 * 1024 * 1024

FORMS = ("logits", "linear")
#: The per-token losses (keys of :data:`functional_ce.maths.LOSSES`).
LOSS_NAMES = ("cross_entropy", "token_logprobs", "distillation")
_REDUCTIONS = ("mean", "sum", "none")


# --- value checks ------------------------------------------------------------------------------


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _integer(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return int(value)


def _in_range(kind: Callable, low: float, high: float, text: str, *, none: bool = False, open_low: bool = False,
              open_high: bool = False) -> Callable[[str, object], Any]:
    """A check that ``value`` is a ``kind`` (:func:`_real` / :func:`_integer`) in the range that
    ``text`` describes (or None when ``none``)."""

    def check(name: str, value: object) -> Any:
        if none and value is None:
            return None
        x = kind(name, value)
        if not ((low < x if open_low else low <= x) and (x < high if open_high else x <= high)):
            raise ValueError(f"{name} must be {'None or ' if none else ''}{text}, got {value!r}")
        return x

    return check


def _one_of(*choices: object, text: Optional[str] = None) -> Callable[[str, object], Any]:
    def check(name: str, value: object) -> Any:
        for c in choices:
            if (value is c) if isinstance(c, bool) or c is None else (value == c and not isinstance(value, bool)):
                return value
        error = TypeError if text else ValueError
        raise error(f"{name} must be {text or f'one of {choices}'}, got {value!r}")

    return check


_unit_interval = _in_range(_real, 0.0, 1.0, "in [0, 1]")
_finite_non_negative = _in_range(_real, 0.0, math.inf, "a finite number >= 0", open_high=True)
_positive = _in_range(_real, 0.0, math.inf, "a finite number > 0", none=True, open_low=True, open_high=True)
_temperature = _in_range(_real, 0.0, math.inf, "a finite number > 0", open_low=True, open_high=True)
_stats_pass = _in_range(_integer, -1, math.inf, "an int >= -1")
_count = _in_range(_integer, 0, math.inf, "an int >= 0")
_classes = _in_range(_integer, 1, math.inf, "an int >= 1", none=True)
_flag = _one_of(True, False, text="a bool")
_flag_or_none = _one_of(True, False, None, text="True, False or None")
_finite = _in_range(_real, -math.inf, math.inf, "a finite number", open_low=True, open_high=True)

#: The extra per-token statistics :func:`functional_ce.token_logprobs` returns on request (TRL's
#: fused LM head's fields): whether the label is the first arg-max of the logits, ``log(sum_v
#: p_v**2)``, and the mean of the tempered logits over the vocabulary. None carries a gradient.
TOKEN_STATS = ("is_top1", "log_sum_sq_probs", "mean_logits")


def _token_stats(name: str, value: object) -> tuple[str, ...]:
    """A sequence of distinct names from :data:`TOKEN_STATS`, as a tuple in the order given."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be a tuple or list of names from {TOKEN_STATS}, got {value!r}")
    names = tuple(value)
    for n in names:
        if n not in TOKEN_STATS:
            raise ValueError(f"{name} must name statistics from {TOKEN_STATS}, got {n!r} in {value!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{name} names a statistic twice: {value!r}")
    return names


_CE, _LOGP, _KD = LOSS_NAMES


def _option(default: Any, check: Callable, *, forms: tuple[str, ...] = FORMS, losses: tuple[str, ...] = LOSS_NAMES,
            maths: bool = True) -> Any:
    """A spec field. ``forms`` and ``losses``: the public loss forms and losses taking it as a
    keyword (``forms=()`` for fields the library fills in); ``maths``: whether the per-chunk maths
    depends on it (compiled chunk graphs specialise on exactly those fields)."""
    return dataclasses.field(default=default, metadata={"check": check, "forms": forms, "losses": losses,
                                                        "maths": maths})


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Every option of one loss call, checked: frozen and hashable.

    Keyword options (the public loss functions take these by name; each says which losses take it):
        ignore_index: label value whose rows contribute no loss and get zero gradient.
        label_smoothing: (cross-entropy) epsilon of ``torch.nn.functional.cross_entropy``'s
            definition, in [0, 1].
        z_loss: (cross-entropy) coefficient of ``logsumexp(logits) ** 2`` added to each valid row's loss.
        softcap: (cross-entropy, log-probs, distillation) if set, logits are replaced by
            ``softcap * tanh(logits / softcap)`` first (distillation: the student's only).
        temperature: (log-probs, distillation) logits are divided by it (after the softcap).
        logit_scale: (log-probs, distillation) logits are multiplied by it first, before the softcap
            (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``; TRL's fused head's
            multiplier; distillation: the student's only).
        teacher_softcap, teacher_logit_scale: (distillation) the same for the teacher's logits,
            set on their own: the teacher is another model, so it never takes the student's
            (None and 1.0 by default: no soft-cap, no scale).
        stats: (log-probs) extra per-token statistics to return, names from :data:`TOKEN_STATS`
            in the order wanted (none carries a gradient).
        return_entropy: (log-probs) also return each token's entropy.
        beta: (distillation) the generalized Jensen-Shannon divergence's mixing weight, in [0, 1].
        reduction: (cross-entropy, distillation) ``"mean"``, ``"sum"`` or ``"none"``.
        compile_chunks: run the chunk maths as compiled graphs (None: ``FUNCTIONAL_CE_COMPILE``).
        inplace_grad: (logits form) backward writes the gradient into the logits' storage.
        recompute_logits_in_backward: (hidden-state form) keep O(N) state and recompute each
            chunk's logits in backward instead of computing the gradients in forward.

    Filled in by the library:
        loss: which per-token loss (a key of :data:`functional_ce.maths.LOSSES`).
        form: ``"logits"`` or ``"linear"`` (logits ``hidden @ weight.T + bias``, built per chunk).
        chunk_rows: token rows per chunk; 0 means all rows in one chunk.
        vocab_start: the class id of a chunk's first column (where this process's slice of a
            sharded vocabulary starts; 0 on one process).
        n_classes: the full vocabulary size V (a chunk may hold only a slice of it).
        stats_pass: which pass of the loss's statistics a chunk computes (a sharded vocabulary
            combines each pass before the next); -1 for all of them at once (one slice).
        teacher_grad: (distillation) whether the second input (the teacher) gets a gradient.
    """

    ignore_index: int = _option(-100, _integer)
    label_smoothing: float = _option(0.0, _unit_interval, losses=(_CE,))
    z_loss: float = _option(0.0, _finite_non_negative, losses=(_CE,))
    softcap: Optional[float] = _option(None, _positive)
    reduction: str = _option("mean", _one_of(*_REDUCTIONS), losses=(_CE, _KD), maths=False)
    compile_chunks: Optional[bool] = _option(None, _flag_or_none, maths=False)
    inplace_grad: bool = _option(False, _flag, forms=("logits",), losses=(_CE,), maths=False)
    recompute_logits_in_backward: bool = _option(False, _flag, forms=("linear",), losses=(_CE, _KD), maths=False)
    temperature: float = _option(1.0, _temperature, losses=(_LOGP, _KD))
    return_entropy: bool = _option(False, _flag, losses=(_LOGP,))
    logit_scale: float = _option(1.0, _finite, losses=(_LOGP, _KD))
    stats: tuple[str, ...] = _option((), _token_stats, losses=(_LOGP,))
    beta: float = _option(0.5, _unit_interval, losses=(_KD,))
    teacher_softcap: Optional[float] = _option(None, _positive, losses=(_KD,))
    teacher_logit_scale: float = _option(1.0, _finite, losses=(_KD,))
    loss: str = _option("cross_entropy", _one_of(*LOSS_NAMES), forms=())
    form: str = _option("logits", _one_of(*FORMS), forms=())
    chunk_rows: int = _option(0, _count, forms=(), maths=False)
    vocab_start: int = _option(0, _count, forms=())
    n_classes: Optional[int] = _option(None, _classes, forms=())
    stats_pass: int = _option(-1, _stats_pass, forms=())
    teacher_grad: bool = _option(False, _flag, forms=())

    def __post_init__(self) -> None:
        for name, check in _CHECKS:
            object.__setattr__(self, name, check(name, getattr(self, name)))

    def encode(self) -> str:
        """The spec as one string argument of a custom operator (:func:`decode` inverts it)."""
        return "|".join([f"{getattr(self, name)!r}" for name, _ in _CHECKS])

    @functools.lru_cache(maxsize=None)  # noqa: B019 (specs are few, small and immortal)
    def maths(self) -> "LossSpec":
        """This spec with the fields the chunk maths ignores at their defaults: what a compiled
        chunk graph specialises on (so reductions and chunk sizes share graphs)."""
        return dataclasses.replace(self, **_DRIVER_DEFAULTS)

    def rows_in(self, n: int) -> int:
        """Rows per chunk for ``n`` rows (at least 1)."""
        return max(1, n if self.chunk_rows == 0 else min(self.chunk_rows, n))


# Read once here: dynamo traces a spec's construction inside a user's compiled loss, and reads
# these plain tuples and dicts where it cannot read dataclass field metadata.
_CHECKS = tuple((f.name, f.metadata["check"]) for f in dataclasses.fields(LossSpec))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossSpec)}
_DRIVER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(LossSpec) if not f.metadata["maths"]}
_SPEC_KEYWORDS = {
    (loss, form): {f.name: f.default for f in dataclasses.fields(LossSpec)
                   if form in f.metadata["forms"] and loss in f.metadata["losses"]}
    for loss in LOSS_NAMES for form in FORMS
}


def __getattr__(name: str) -> Any:
    if name == "ChunkOptions":  # kept for one release: the per-chunk options are fields of LossSpec now
        warnings.warn("functional_ce.ChunkOptions is deprecated and will be removed in the next minor release; "
                      "use functional_ce.LossSpec", DeprecationWarning, stacklevel=2)
        return LossSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def decode(encoded: str) -> LossSpec:
    """The :class:`LossSpec` that :meth:`LossSpec.encode` wrote."""
    values = [ast.literal_eval(part) for part in encoded.split("|")]
    return LossSpec(*values)


#: Per-batch keywords (not held by the ``nn.Module`` forms) -> the losses taking them; the chunk size.
BATCH_KEYWORDS = {"mask": None, "weights": None, "num_label_tokens": None}
_BATCH_LOSSES = {"mask": LOSS_NAMES, "weights": (_CE,), "num_label_tokens": (_CE, _KD)}
CHUNK_KEYWORD = {"chunk_size": "auto"}


def keyword_defaults(form: str, *, loss: str = "cross_entropy", batch: bool = True) -> dict[str, Any]:
    """Every keyword option of ``loss`` in the ``form`` form with its default (``batch=False``:
    without the per-batch ones, what the ``nn.Module`` forms hold)."""
    per_batch = {k: v for k, v in BATCH_KEYWORDS.items() if batch and loss in _BATCH_LOSSES[k]}
    return {**per_batch, **_SPEC_KEYWORDS[(loss, form)], **CHUNK_KEYWORD}


def check_keywords(form: str, options: dict[str, Any], *, loss: str = "cross_entropy",
                   batch: bool = True) -> dict[str, Any]:
    """``options`` with defaults filled in, every value checked: ``TypeError`` for a keyword the
    loss's form does not take, and the spec's own errors for a bad value."""
    merged = with_defaults(form, options, loss=loss, batch=batch)
    check_chunk_size(merged["chunk_size"])
    LossSpec(**spec_part(merged))
    return merged


def with_defaults(form: str, options: dict[str, Any], *, loss: str = "cross_entropy",
                  batch: bool = True) -> dict[str, Any]:
    """``options`` over the defaults of ``loss``'s keywords; ``TypeError`` naming unknown ones."""
    known = keyword_defaults(form, loss=loss, batch=batch)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; {loss} ({form} form) takes {sorted(known)}")
    return {**known, **options}


def spec_part(options: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` that are :class:`LossSpec` fields."""
    return {k: v for k, v in options.items() if k in _DEFAULTS}


def keyword_signature(fn: Callable, form: str, *, loss: str = "cross_entropy", batch: bool = True) -> Callable:
    """Give ``fn(..., **options)`` the signature that lists the keywords of ``loss``'s ``form``
    (``help``, ``inspect.signature``, editors); they are declared once, on :class:`LossSpec`."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
               for name, default in keyword_defaults(form, loss=loss, batch=batch).items()
               if name not in sig.parameters]
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return fn


# --- chunk sizing ------------------------------------------------------------------------------


def check_chunk_size(chunk_size: object) -> None:
    """``chunk_size`` must be a positive int, ``"auto"`` or None."""
    if chunk_size == "auto" or chunk_size is None:
        return
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f'chunk_size must be a positive int, "auto" or None, got {chunk_size!r}')
    if chunk_size <= 0:
        raise ValueError(f'chunk_size must be a positive int, "auto" or None, got {chunk_size}')


def linear_auto_chunk(device: torch.device) -> tuple[int, int]:
    """``(rows, fp32 chunk byte cap)`` of the hidden-state form's ``chunk_size="auto"`` on ``device``."""
    if device.type == "cuda":
        return LINEAR_AUTO_CHUNK_ROWS_CUDA, LINEAR_AUTO_CHUNK_BYTES_CUDA
    return LINEAR_AUTO_CHUNK_ROWS, LINEAR_AUTO_CHUNK_BYTES


def requested_chunk_rows(chunk_size: ChunkSize, row_bytes: int, auto_bytes: Optional[int],
                         auto_rows: Optional[int]) -> int:
    """Rows per chunk before clamping to the row count; 0 for one chunk."""
    check_chunk_size(chunk_size)
    if chunk_size is None:
        return 0
    if chunk_size != "auto":
        return int(chunk_size)
    budget = AUTO_CHUNK_BYTES if auto_bytes is None else auto_bytes
    rows = max(1, budget // max(1, row_bytes))
    if auto_rows is not None:
        rows = min(rows, auto_rows)
    if rows >= 64:
        rows -= rows % 32  # aligned chunks vectorise better
    return rows


def resolve_chunk_size(
    chunk_size: ChunkSize, n_rows: int, row_bytes: int, auto_bytes: Optional[int] = None,
    auto_rows: Optional[int] = None,
) -> int:
    """Rows per chunk for ``n_rows`` rows whose fp32 form takes ``row_bytes`` bytes each.

    ``"auto"`` takes ``auto_rows`` rows (no limit when None), fewer where one fp32 chunk would
    pass ``auto_bytes`` (default ``AUTO_CHUNK_BYTES``); ``None`` is one chunk.
    """
    rows = requested_chunk_rows(chunk_size, row_bytes, auto_bytes, auto_rows)
    return max(1, n_rows if rows == 0 else min(rows, n_rows))
