"""A loss patch's global state, scoped to the model the patch is on and released with it.

A loss patch on one model installs state that every model in the process can see (TRL's kernels
replaced so that they refuse unrouted calls; Transformers' ``LOSS_MAPPING``). Two pieces keep that
state about its model, holding the model only through weak references:

- :class:`ModelScope` says whether a kernel call computes for the model: the model's own call is
  under way (forward hooks; TRL's fused head runs inside ``model(...)`` and ``DistillationTrainer``
  runs its divergence inside the student's call), or the kernel was handed the model's current
  output-embedding weight (a kernel called outside the model's call, for example under a wrapper
  that calls ``forward`` directly). A call for any other model is none of its business.
- :class:`ReleaseWithModel` removes a handle when its model is garbage-collected, so that a handle
  dropped without ``remove()`` (or skipped by an exception) does not outlive its model.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Optional

import torch.nn as nn

from patch_layer import Handle

__all__ = ["ModelScope", "Refusal", "ReleaseWithModel", "model_name", "REFUSALS", "ROUTED", "refusal", "trl_heads_routed"]

logger = logging.getLogger(__name__)


def model_name(model: Optional[nn.Module]) -> str:
    """``model``'s class name, for messages and ``repr``; ``"model"`` for None."""
    return "model" if model is None else type(model).__name__


class ModelScope(Handle):
    """A weak reference to one model and whether a kernel call concerns it (:meth:`concerns`).

    Two forward hooks count the model's calls under way (a pre-hook that runs first, and an
    ``always_call`` forward hook, so a call that raises is counted out too). ``remove()`` takes
    them off; a collected model takes them with it.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._model = weakref.ref(model)
        self.name = model_name(model)
        self._depth = 0
        self._hooks = (
            model.register_forward_pre_hook(self._enter, prepend=True),
            model.register_forward_hook(self._leave, always_call=True),
        )

    @property
    def model(self) -> Optional[nn.Module]:
        """The model, or None once it was garbage-collected."""
        return self._model()

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self._depth += 1

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        # at 0 already: a pre-hook prepended later raised before this one ran
        self._depth = max(0, self._depth - 1)

    def concerns(self, weight: Any = None) -> bool:
        """Whether a kernel call computing with ``weight`` (an LM head's ``[V, H]`` weight, or
        None when unknown) is for this model: its call is under way, or ``weight`` is its current
        output embedding's weight (the same tensor object). False once the model is gone or this
        scope was removed."""
        model = self._model()
        if model is None or not self.active:
            return False
        if self._depth:
            return True
        if weight is None:
            return False
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        return head is not None and getattr(head, "weight", None) is weight

    def __getstate__(self) -> dict[str, Any]:
        # copied with its model (the hooks are bound to it): the copy's scope is the copied model's
        return {**self.__dict__, "_model": self._model()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _model=weakref.ref(state["_model"]))

    def _undo(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _describe(self) -> str:
        return f"scope of {self.name}" + ("" if self._model() is not None else " (collected)")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A refusal's message and the model it is for (``scope`` None: every model)."""

    message: str
    scope: Optional[ModelScope] = None

    def concerns(self, weight: Any = None) -> bool:
        """Whether it refuses a kernel call computing with ``weight`` (see :meth:`ModelScope.concerns`)."""
        return self.scope is None or self.scope.concerns(weight)

    @property
    def live(self) -> bool:
        """False once its model was garbage-collected."""
        return self.scope is None or self.scope.model is not None

    @property
    def who(self) -> str:
        return "every model" if self.scope is None else self.scope.name


def _release(owner: Handle, name: str) -> None:
    """Remove ``owner`` once its model is gone; a failure is logged (a finalizer must not raise)."""
    try:
        owner.remove()
    except Exception as exc:  # noqa: BLE001 - logged with the reason, nothing else can be done here
        logger.warning("%r: its %s was garbage-collected, but the handle could not be removed: %s", owner, name, exc)
    else:
        logger.info("released %r: its %s was garbage-collected", owner, name)


class ReleaseWithModel(Handle):
    """A companion of ``owner`` (a handle of a patch on ``model``): ``owner.remove()`` runs when
    ``model`` is garbage-collected, even if ``owner`` itself was dropped. Removing this companion
    (which ``owner.remove()`` does) cancels that. Holds ``owner``, never ``model``."""

    def __init__(self, model: nn.Module, owner: Handle) -> None:
        self._name = model_name(model)
        self._finalizer = weakref.finalize(model, _release, owner, self._name)
        self._finalizer.atexit = False  # at exit the process's patches go with it

    def _undo(self) -> None:
        self._finalizer.detach()

    def _describe(self) -> str:
        return f"release with {self._name}"


# --- which mode TRL's routed heads are in ---------------------------------------------------------
# The live handles of :func:`~model_patches.enable_trl_heads` (routed to functional_ce) and of
# :func:`~model_patches.loss.trl_heads.refuse_unrouted_trl_heads` (refusing): state that the records
# (:mod:`model_patches.loss.trl_heads`) change and the unused-loss watch reads.
# The live handles of each mode (a handle's id -> None, or its refusal). Read without a lock at
# call time (one dict/len read); changed under the registry's handles only.
ROUTED: dict[int, None] = {}
REFUSALS: dict[int, Refusal] = {}


def refusal(weight: Any = None) -> Optional[str]:
    """While nothing routes, the message of the oldest refusal that concerns a kernel call
    computing with the LM head weight ``weight``, else None."""
    if ROUTED or not REFUSALS:
        return None
    for entry in list(REFUSALS.values()):  # a copy: a collected model may drop its entry meanwhile
        if entry.concerns(weight):
            return entry.message
    return None


def trl_heads_routed() -> bool:
    """True while an :func:`enable_trl_heads` handle is active."""
    return bool(ROUTED)
