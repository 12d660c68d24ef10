"""Which mode TRL's routed heads are in: the live handles of :func:`~model_patches.enable_trl_heads`
(routed to functional_ce) and of :func:`~model_patches.loss.trl_heads.refuse_unrouted_trl_heads`
(refusing). Kept apart from the records so that the loss-use watch
(:mod:`model_patches.loss.loss_use`) can read the mode without importing the records, which import it.
"""

from __future__ import annotations

from typing import Any, Optional

from .model_scope import Refusal

__all__ = ["REFUSALS", "ROUTED", "refusal", "trl_heads_routed"]

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
