"""The one seam where ``ac_policies`` meets the patches of other packages, at run time only.

``ac_policies`` sits beside ``model_patches``: it imports neither it nor Transformers at module
level. Three things combine them, and all go through here, importing what they need when they run:

- :func:`policy_companions`: the handles a policy's handle takes with it. Where Transformers is in
  use (imported), that is ``model_patches``' Trainer resume conversion, which every patch of this
  distribution turns on: a resumed MoE run restores its experts
  (:mod:`model_patches.checkpoint_resume`).
- the loss patches that ``python -m ac_policies.estimate --loss NAME`` (and any caller of
  :func:`apply_loss_patch`) applies to the model before estimating: ``stock`` (none), and the
  ones registered by name. ``linear`` and ``chunked`` are ``model_patches``'
  :func:`~model_patches.enable_linear_cross_entropy` and :func:`~model_patches.enable_chunked_loss`;
  another package's loss patch registers itself with :func:`register_loss_patch` (a function
  ``model -> handle``), and the command then offers it too.
- :func:`recorded_outputs`: the outputs Transformers is recording from inside a forward (its
  output capturing: ``output_router_logits``, ``output_hidden_states``), which a ``tile`` rule
  merges back to one entry per call of the tiled module.
- :func:`unpacked_rows_on_fakes`: how Transformers' mask code reads ``position_ids`` on the fake
  tensors of an estimate.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

__all__ = ["policy_companions", "recorded_outputs", "unpacked_rows_on_fakes", "register_loss_patch", "loss_patch_names", "apply_loss_patch", "LOSS_ALIASES"]

#: A loss patch: ``"module:function"`` of a package that ``ac_policies`` may not import at module
#: level (imported when it is applied), or the function itself.
LossPatch = Union[str, Callable[[nn.Module], Any]]

_LOSS_PATCHES: dict[str, LossPatch] = {
    "linear": "model_patches:enable_linear_cross_entropy",
    "chunked": "model_patches:enable_chunked_loss",
}
#: Old ``--loss`` names, still accepted: ``hidden_state`` is the linear (hidden-state) form.
LOSS_ALIASES = {"hidden_state": "linear"}


def policy_companions() -> list[Any]:
    """The handles :func:`~ac_policies.apply_policy` removes with the policy: ``model_patches``'
    Trainer resume conversion where Transformers is imported, else none."""
    if "transformers" not in sys.modules:
        return []
    from model_patches.checkpoint_resume import RESUME_RECORDS, RESUME_WHAT
    from model_patches.registry import apply_records

    return [apply_records(RESUME_RECORDS, strict=False, what=RESUME_WHAT)]


def recorded_outputs() -> Optional[dict[str, Any]]:
    """The dict of lists Transformers' output capturing is filling in the forward running now
    (``transformers.utils.output_capturing``, Transformers 5), or None: no forward is recording,
    Transformers is not imported, or its release keeps the lists out of reach (4.x keeps them in a
    closure; there the recorders of the MoE families sit on the MoE block, whose merged output
    they see)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    if collector is None:
        return None
    if torch.compiler.is_compiling():
        # dynamo cannot read a ContextVar; Transformers' wrapper holds the value in a plain attribute
        # when it was set while compiling, and that is the only one a compiled region can see
        found = collector.global_var if getattr(collector, "compiling", False) else None
    else:
        found = collector.get()
    return found if isinstance(found, dict) else None


@contextlib.contextmanager
def unpacked_rows_on_fakes() -> Iterator[None]:
    """While an estimate runs: Transformers' detection of packed rows from ``position_ids``
    (``masking_utils.find_packed_sequence_indices``, 5.x) answers "not packed" for fake
    ``position_ids``.

    On real tensors it reads the values and, for ordinary rows (positions 0..T-1), lets sdpa run
    with ``is_causal`` and no mask; on fake tensors it cannot read them and builds a ``[T, T]``
    mask the real step never builds, which at long context would dominate the estimate. Packed
    batches are the packing patch's (``model_patches.enable_packing``), which builds its own masks
    and whose bytes the estimate counts as they are.
    """
    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return

    def unpacked_when_fake(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        return None if is_fake(position_ids) else find(position_ids)

    masking.find_packed_sequence_indices = unpacked_when_fake
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


def register_loss_patch(name: str, enable: LossPatch) -> None:
    """Offer ``enable(model) -> handle`` as the loss patch ``name`` (``--loss name``).

    Raises:
        ValueError: ``name`` is ``stock`` or already registered to something else.
    """
    if name == "stock" or name in LOSS_ALIASES or _LOSS_PATCHES.get(name, enable) is not enable:
        raise ValueError(f"the loss patch name {name!r} is taken; registered: {loss_patch_names()}")
    _LOSS_PATCHES[name] = enable


def loss_patch_names() -> list[str]:
    """``stock`` and every registered loss patch, in registration order."""
    return ["stock", *_LOSS_PATCHES]


def apply_loss_patch(model: nn.Module, name: str) -> Any:
    """Apply the loss patch ``name`` to ``model``; its handle (None for ``stock``)."""
    name = LOSS_ALIASES.get(name, name)
    if name == "stock":
        return None
    if name not in _LOSS_PATCHES:
        raise ValueError(f"unknown loss patch {name!r}; choose one of {loss_patch_names()}")
    enable = _LOSS_PATCHES[name]
    if isinstance(enable, str):
        module, _, function = enable.partition(":")
        enable = getattr(importlib.import_module(module), function)
    return enable(model)
