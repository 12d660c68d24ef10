"""Sequence packing that keeps documents apart, on every attention backend and supported release.

- :mod:`.enable`: ``enable_packing``, ``check_model``, ``packing_status`` (the public side).
- :mod:`.table`: the records as a table, and its one expansion over imported model modules.
- :mod:`.coverage`: what a family must have document-aware (capabilities), as data.
- the builders the records install: :mod:`.mask_builders` (masks, flash ``cu_seqlens``),
  :mod:`.guards` (refusals), :mod:`.aux_loss`, :mod:`.alibi`, :mod:`.document_mixers`.
- :mod:`.masks`: the pure document-id maths; :mod:`.collator`: ``PackingCollator``.
"""

import importlib
from typing import Any

_LAZY = {"enable_packing": "enable", "packing_status": "enable", "check_model": "enable", "PackingCollator": "collator"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
