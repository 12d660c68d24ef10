"""``Handle``: what every patch of this distribution returns, and its one undo behaviour.

A handle undoes exactly what its patch did. ``remove()`` first asks the handle whether its undo
can run (:meth:`Handle._check`): when code installed after the patch wrapped it, the patch is taken
out from under that code where that code holds it in a place that can be found (a closure cell, an
attribute of a callable object, along ``__wrapped__`` chains; see :mod:`patch_layer.unwrap`); the
later code stays installed and calls what the patch wrapped. Where it cannot be found, ``remove()``
raises :class:`WrappedByLaterCode` (a ``ValueError``) and changes nothing: restoring the original
would delete the later code. Then the handle's companions (hooks, guards, finalizers that belong to
the same patch) are removed, last added first, and the handle's own undo runs. Removing twice is a
no-op.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

__all__ = ["Handle", "WrappedByLaterCode", "LOCK"]

#: Held while any handle patches or undoes, so two threads never interleave on one target.
LOCK = threading.RLock()


class WrappedByLaterCode(ValueError):
    """A handle cannot undo its patch: code installed after it holds it in a way that cannot be
    unwrapped. Remove that later patch first, then the handle."""


class Handle:
    """Undo handle: ``remove()``, a read-only ``active``, a ``repr``, and ``with`` support.

    Subclasses implement :meth:`_undo` (the undo itself, which may assume :meth:`_check` passed)
    and :meth:`_describe`, and :meth:`_check` when later code may have wrapped what they
    installed. ``companions``: handles removed with this one, last added first.
    """

    _removed = False

    def __init__(self, companions: Sequence["Handle"] = ()) -> None:
        self.companions: list[Handle] = list(companions)

    @property
    def active(self) -> bool:
        """True until :meth:`remove` succeeds."""
        return not self._removed

    def remove(self) -> None:
        """Undo what this handle did (see :mod:`patch_layer.handle`)."""
        with LOCK:
            if not self.active:
                return
            self._check()
            for companion in reversed(getattr(self, "companions", ())):
                companion.remove()
            self._undo()
            self._removed = True

    def _check(self) -> None:
        """Raise :class:`WrappedByLaterCode`, changing nothing, when the undo cannot run."""

    def _undo(self) -> None:
        raise NotImplementedError

    def _describe(self) -> str:
        raise NotImplementedError

    def refuse_wrapped(self, what: str, by: Any = None) -> WrappedByLaterCode:
        """The error :meth:`_check` raises when ``what`` was wrapped by code that holds the patch
        where it cannot be found (``by``: that code, when known)."""
        later = f" ({getattr(by, '__qualname__', type(by).__name__)})" if by is not None else ""
        return WrappedByLaterCode(
            f"cannot remove {self!r}: {what} was replaced after this patch by other code{later} that holds the "
            "patch in a way that cannot be unwrapped; restoring the original would delete that code. "
            "Remove the later patch first, then call handle.remove()"
        )

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._describe()}, {'removed' if self._removed else 'active'}>"
