"""TRL's fused LM head and its chunked divergence, computed by functional_ce.

TRL's trainers (SFT, GRPO, RLOO, DPO, KTO) add a fused LM head to the model
(``trl.trainer.utils.add_fused_lm_head``); called with ``fused_lm_head=True`` its forward looks up
the module global ``trl.trainer.utils._ChunkedLogProbFunction`` at call time and calls its
``.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
logit_scale, outputs)``. TRL's ``DistillationTrainer`` calls the module function
``trl.trainer.distillation_trainer._chunked_divergence_loss`` the same way. Two registry records
(table ``"trl"``, gated on the TRL version) replace those two names, so every TRL head, added
before or after, in every TRL trainer, goes through the replacement. TRL's temperature, logit
scales and final-logit soft-caps become functional_ce's own options (for the divergence, each
model's: ``logit_scale``/``softcap`` for the student, ``teacher_logit_scale``/``teacher_softcap``
for the teacher), so soft-capped models (Gemma 2/3) are routed too.

Each replacement decides at call time, from the mode state of :mod:`model_patches.loss.per_model_state`:

- an :func:`enable_trl_heads` handle is active: compute with
  :func:`functional_ce.linear_token_logprobs` (with its ``stats``) /
  :func:`functional_ce.linear_distillation_loss`, same arguments, same returns;
- else a :func:`refuse_unrouted_trl_heads` handle concerns the call (one without a model: every
  call; with ``model=``: that model's calls, see :class:`~model_patches.loss.per_model_state.ModelScope`):
  raise ``ValueError`` with its message (a loss patch TRL's head would bypass is refused, not
  silently unused);
- else call TRL's own object.

Both public functions apply the same records, so their handles share the registry's per-target
reference counts; the original objects come back when the last handle is removed.

Applying the records imports ``trl.trainer.utils`` and ``trl.trainer.distillation_trainer``:
about 2 s on first use with torch and Transformers already imported (1.8-2.3 s measured with
TRL 1.16.0 on the 2-core CPU machine of bench/RESULTS.md).

Layouts: TRL's forward turns a DTensor ``lm_head`` weight (FSDP2, or a tensor-parallel head)
into a plain tensor with ``weight.full_tensor()`` before it calls the kernel, so the routed kernel
sees the gathered ``[V, H]`` weight on every process, as TRL's own does; it never sees the
shards. To keep a vocabulary-sharded head sharded, compute the log-probs with
:func:`model_patches.causal_lm_token_logprobs` (DTensor vocabulary-parallel in functional_ce)
instead of TRL's fused head. A DeepSpeed ZeRO-3 head is routed too: TRL reads its partitioned
weight inside the model's forward, where ZeRO-3 gathers it, and ZeRO-3 gathers it again for the
backward (see :mod:`model_patches.loss.trl_compute`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

import torch.nn as nn

from patch_layer import Handle

from ..checkpoint_resume import RESUME_RECORDS, RESUME_WHAT
from ..registry import PatchHandle, PatchRecord, StatusRow, StatusTable, apply_records, package_version, record_status
from ..targets import parameters_probe
from .per_model_state import REFUSALS, ROUTED, ModelScope, Refusal, ReleaseWithModel, refusal, trl_heads_routed
from .trl_compute import OPTIONAL_OUTPUTS, routed_divergence, routed_logprobs

__all__ = [
    "enable_trl_heads", "refuse_unrouted_trl_heads", "routed_divergence", "routed_logprobs", "trl_heads_routed",
    "trl_heads_status",
]

logger = logging.getLogger(__name__)

HEAD_TARGET = "trl.trainer.utils:_ChunkedLogProbFunction"
DIVERGENCE_TARGET = "trl.trainer.distillation_trainer:_chunked_divergence_loss"
TRL_VERSIONS = ">=1.16,<2"
NEWEST_TESTED_TRL = "1.16.0"

_HEAD_PARAMETERS = ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                    "final_logit_softcapping", "logit_scale", "outputs")
_DIVERGENCE_PARAMETERS = (
    "student_hidden_states", "teacher_hidden_states", "student_lm_head_weight", "teacher_lm_head_weight",
    "completion_mask", "beta", "num_items_in_batch", "student_lm_head_bias", "teacher_lm_head_bias",
    "student_logit_scale", "teacher_logit_scale", "student_final_logit_softcapping",
    "teacher_final_logit_softcapping", "temperature",
)

# --- the replacements: one per target, dispatching on the mode at call time -------------------


def _argument(args: tuple, kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)  # positional or keyword


class RoutedChunkedLogProb:
    """Stands in for TRL's ``ChunkedLogProbFunction``: ``.apply`` takes its arguments and returns
    its 5-tuple; every other attribute is the original's (``__wrapped__``)."""

    def __init__(self, original: Any) -> None:
        self.__wrapped__ = original

    def apply(self, *args: Any, **kwargs: Any) -> tuple:
        if ROUTED:
            return routed_logprobs(*args, **kwargs)
        message = refusal(_argument(args, kwargs, 1, "weight"))
        if message is not None:
            raise ValueError(message)
        return self.__wrapped__.apply(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return f"<RoutedChunkedLogProb of {self.__wrapped__!r}>"


def _build_head(original: Any) -> RoutedChunkedLogProb:
    return RoutedChunkedLogProb(original)


def _build_divergence(original: Any) -> Any:
    @functools.wraps(original)
    def chunked_divergence_loss(*args: Any, **kwargs: Any) -> tuple:
        if ROUTED:
            return routed_divergence(*args, **kwargs)
        message = refusal(_argument(args, kwargs, 2, "student_lm_head_weight"))
        if message is not None:
            raise ValueError(message)
        return original(*args, **kwargs)

    return chunked_divergence_loss


def _probe_head(original: Any) -> Optional[str]:
    if not hasattr(original, "apply") or not hasattr(original, "forward"):
        return f"expected an autograd Function with apply/forward, got {original!r}"
    reason = parameters_probe(original.forward, first=_HEAD_PARAMETERS)
    if reason:
        return reason
    from trl.kernels import chunked_logprob

    found = tuple(getattr(chunked_logprob, "OPTIONAL_OUTPUTS", ()))
    if found != OPTIONAL_OUTPUTS:
        return f"expected the kernel's optional outputs {OPTIONAL_OUTPUTS}, found {found}"
    return None


def _probe_divergence(original: Any) -> Optional[str]:
    return parameters_probe(original, first=_DIVERGENCE_PARAMETERS)


RECORDS = (
    PatchRecord(
        name="trl_fused_lm_head", target=HEAD_TARGET, versions=TRL_VERSIONS, probe=_probe_head, build=_build_head,
        doc="TRL's fused LM head kernel (SFT, GRPO, RLOO, DPO, KTO) on functional_ce.linear_token_logprobs",
        newest_tested=NEWEST_TESTED_TRL, table="trl", package="trl",
    ),
    PatchRecord(
        name="trl_chunked_divergence", target=DIVERGENCE_TARGET, versions=TRL_VERSIONS, probe=_probe_divergence,
        build=_build_divergence,
        doc="DistillationTrainer's chunked divergence on functional_ce.linear_distillation_loss",
        newest_tested=NEWEST_TESTED_TRL, table="trl", package="trl",
    ),
)


# --- handles and public functions --------------------------------------------------------------


def _trl_version() -> Optional[str]:
    return package_version("trl")


_NOT_INSTALLED = "trl is not installed"


class _ModeEntry(Handle):
    """One handle's entry in a mode's registry; a companion of the records' handle, so it is
    dropped only once that handle's checks pass."""

    def __init__(self, mode: dict, value: Any) -> None:
        self._mode = mode
        mode[id(self)] = value

    def _undo(self) -> None:
        self._mode.pop(id(self), None)

    def _describe(self) -> str:
        return "trl heads mode entry"


class _NoTrlHandle(Handle):
    """What the public functions return without TRL: nothing to patch, nothing to undo."""

    def __init__(self, what: str) -> None:
        self._what = what
        self.rows = StatusTable(StatusRow(r.name, r.target, r.versions, "skipped", _NOT_INSTALLED) for r in RECORDS)

    def _undo(self) -> None:
        pass

    def _describe(self) -> str:
        return f"{self._what}: trl not installed, 0 patches"


def _enable(mode: dict, value: Any, what: str, strict: bool) -> Handle:
    version = _trl_version()
    if version is None:
        return _NoTrlHandle(what)
    handle = apply_records(RECORDS, strict=strict, version=version, what=what)
    handle.companions.append(_ModeEntry(mode, value))
    return handle


def enable_trl_heads(*, strict: bool = True) -> PatchHandle:
    """Compute TRL's fused LM heads and DistillationTrainer's chunked divergence with functional_ce.

    Routes ``trl.trainer.utils._ChunkedLogProbFunction`` (every trainer's fused head: SFT, GRPO,
    RLOO, DPO, KTO; the log-probs, entropy, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``,
    with TRL's temperature, soft-cap and logit scale) and
    ``trl.trainer.distillation_trainer._chunked_divergence_loss``. Both are looked up by TRL at call
    time, so the order does not matter: enable before or after building the trainer. The outputs
    have TRL's fields and dtypes, and match TRL's own kernel to float rounding (bf16 heads: to bf16
    rounding). Soft-capped models are routed with their own soft-caps. See the module docstring for
    DTensor heads and ZeRO-3.

    Args:
        strict: a TRL release inside the gate whose objects have another signature raises
            :class:`~model_patches.PatchError` (``False``: a warning, that record left out).

    Returns:
        A handle; ``remove()`` (or leaving a ``with`` block) undoes it. Handles are reference
        counted: TRL's objects come back when the last handle of :func:`enable_trl_heads` and
        :func:`refuse_unrouted_trl_heads` is removed. Without TRL: a handle that patched nothing
        (its ``rows`` say why).
    """
    handle = _enable(ROUTED, None, "trl heads", strict)
    if isinstance(handle, PatchHandle):
        handle.companions.append(apply_records(RESUME_RECORDS, strict=False, what=RESUME_WHAT))
    return handle  # type: ignore[return-value]


def refuse_unrouted_trl_heads(message: str, *, model: Optional[nn.Module] = None,
                              scope: Optional[ModelScope] = None) -> Handle:
    """While the returned handle is active and no :func:`enable_trl_heads` handle is, TRL's fused
    head kernel and chunked divergence raise ``ValueError(message)`` instead of computing, for
    ``model`` only, or for every model when ``model`` is None.

    For a patch of this library that changes the loss (the chunked loss, the hidden-state loss)
    and that TRL's fused head would bypass: it calls this while it is active, so that a TRL
    trainer using its own fused head fails with ``message`` rather than silently training
    without the patch. With several concerning one call, the oldest message is raised. A TRL
    release whose objects do not fit is logged as a warning and nothing is refused. Without TRL: a
    no-op handle.

    Args:
        message: what the refused call raises (the patch, the model, the fix).
        model: the model the patch is on. A kernel call is refused only when it computes for this
            model: the model's call is under way (TRL's fused head runs inside it, and so does
            ``DistillationTrainer``'s divergence for its student), or the kernel is handed this
            model's LM head weight. Any other model trains with TRL's own kernel. The handle holds
            the model weakly and removes itself when the model is garbage-collected.
        scope: the :class:`ModelScope` of ``model`` to use (a patch that keeps its scope, so that a
            copy of the model carries one); by default one is made. It is removed with the handle.
    """
    if not isinstance(message, str) or not message:
        raise TypeError(f"message must be a non-empty str, got {message!r}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if model is None or _trl_version() is None:
        return _enable(REFUSALS, Refusal(message), "trl heads refusal", strict=False)
    scope = scope if scope is not None else ModelScope(model)
    try:
        handle = _enable(REFUSALS, Refusal(message, scope), f"trl heads refusal for {scope.name}", strict=False)
    except BaseException:
        scope.remove()
        raise
    # removed last first: the release is cancelled, the entry dropped, then the hooks taken off
    handle.companions[:0] = [scope]
    handle.companions.append(ReleaseWithModel(model, handle))
    return handle


def trl_heads_status() -> StatusTable:
    """One row per record of the ``"trl"`` table: applied / available / skipped / failed, and why
    (an applied row's reason also says which mode is in force: routed, refusing, or TRL's own)."""
    version = _trl_version()
    if version is None:
        return StatusTable(StatusRow(r.name, r.target, r.versions, "skipped", _NOT_INSTALLED) for r in RECORDS)
    return StatusTable(dataclasses.replace(row, reason=f"{row.reason}; {_mode()}") if row.state == "applied" else row
                       for row in record_status(RECORDS, version=version))


def _mode() -> str:
    """Which mode is in force, for :func:`trl_heads_status`."""
    live = [r for r in list(REFUSALS.values()) if r.live]
    if ROUTED or not live:
        return "routed to functional_ce" if ROUTED else "TRL's own"
    return f"refusing for {live[0].who}{f' (and {len(live) - 1} more)' if len(live) > 1 else ''}: {live[0].message}"
