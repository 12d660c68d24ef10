"""The patch layer under every handle of this distribution: torch and the standard library only.

``model_patches`` and ``ac_policies`` both stand on it (and import nothing of each other):

- :class:`Handle` (:mod:`.handle`): what every patch returns: ``remove()``, ``active``, a ``repr``,
  ``with`` support, companions removed with it, and the one behaviour when later code wrapped the
  patch (taken out from under that code, or refused with nothing changed).
- the ledgers (:mod:`.ledger`): :class:`AttributeLedger` of the attributes patched process-wide
  (one :class:`AttributePatch` per target, reference counted), and :func:`track` /
  :func:`tracked`, the handles acting on one object, keyed weakly by it.
- the instance-forward swap (:mod:`.forward_swap`): :func:`swap_forward` and :func:`restore_forward`.
- unwrapping (:mod:`.unwrap`): :func:`holder_of` and :func:`unwrap_from_under` find where code
  installed later holds a patch and re-point it.
"""

from .forward_swap import forward_below, restore_forward, swap_forward, wrapped_forward
from .handle import Handle, WrappedByLaterCode
from .ledger import AttributeLedger, AttributePatch, track, tracked
from .unwrap import holder_of, holding_cell, unwrap_from_under

__all__ = [
    "Handle",
    "WrappedByLaterCode",
    "AttributeLedger",
    "AttributePatch",
    "track",
    "tracked",
    "swap_forward",
    "restore_forward",
    "forward_below",
    "wrapped_forward",
    "holder_of",
    "holding_cell",
    "unwrap_from_under",
]
