"""The ledgers of active patches.

- :class:`AttributeLedger`: attributes patched process-wide (a module function, a class method),
  one :class:`AttributePatch` per target, reference counted: applying the same patch twice is
  one patch, and the original comes back when the last handle holding it releases it.
- :func:`track` / :func:`tracked`: the handles acting on one object (a model), keyed weakly by
  it, so an entry goes with its object and a removed handle is no longer listed.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Iterator, Optional

from .handle import LOCK, Handle

__all__ = ["AttributePatch", "AttributeLedger", "track", "tracked"]


@dataclasses.dataclass
class AttributePatch:
    """One patched attribute: ``owner.attribute`` holds ``replacement`` in place of ``original``,
    for ``refcount`` live handles; ``source`` is what made it (a patch record)."""

    target: str
    owner: Any
    attribute: str
    original: Any
    replacement: Any
    source: Any = None
    refcount: int = 1

    @property
    def live(self) -> bool:
        """Whether the attribute holds the replacement now (later code may have replaced it)."""
        return getattr(self.owner, self.attribute, None) is self.replacement


class AttributeLedger:
    """Target (``"module:attr[.attr]"``) -> :class:`AttributePatch`, for the attributes one table of
    patches holds. Reads are lock-free dict lookups (patched code calls :meth:`get` at forward
    time, inside compiled graphs); changes hold the layer's lock."""

    def __init__(self) -> None:
        self._patches: dict[str, AttributePatch] = {}

    def get(self, target: str) -> Optional[AttributePatch]:
        return self._patches.get(target)

    def __contains__(self, target: str) -> bool:
        return target in self._patches

    def __iter__(self) -> Iterator[AttributePatch]:
        return iter(list(self._patches.values()))

    def install(self, target: str, owner: Any, attribute: str, replacement: Any, source: Any = None) -> AttributePatch:
        """Set ``owner.attribute = replacement`` and record it (the first patch of ``target``)."""
        with LOCK:
            if target in self._patches:
                raise ValueError(f"{target} is already in the ledger; acquire() it instead")
            patch = AttributePatch(target, owner, attribute, getattr(owner, attribute), replacement, source)
            setattr(owner, attribute, replacement)
            self._patches[target] = patch
            return patch

    def acquire(self, target: str) -> AttributePatch:
        """One more handle holds ``target``'s patch."""
        with LOCK:
            patch = self._patches[target]
            patch.refcount += 1
            return patch

    def release(self, target: str) -> Optional[AttributePatch]:
        """One handle fewer holds ``target``'s patch; the patch, taken out of the ledger, when that
        was the last (the caller restores the attribute), else None."""
        with LOCK:
            patch = self._patches.get(target)
            if patch is None:
                return None
            patch.refcount -= 1
            if patch.refcount > 0:
                return None
            del self._patches[target]
            return patch


_BY_OBJECT: "weakref.WeakKeyDictionary[Any, list[Handle]]" = weakref.WeakKeyDictionary()


def track(obj: Any, handle: Handle) -> None:
    """Record that ``handle`` acts on ``obj`` (a model): the patches that take one call this."""
    with LOCK:
        _BY_OBJECT.setdefault(obj, []).append(handle)


def tracked(obj: Any) -> list[Handle]:
    """The active handles recorded for ``obj`` itself (not for the modules inside it)."""
    return [h for h in _BY_OBJECT.get(obj, ()) if h.active]
