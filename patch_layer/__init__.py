"""The patch layer under every handle of this distribution: torch and the standard library only.

``model_patches`` and ``ac_policies`` both stand on it (and import nothing of each other). It holds:

- :class:`Handle`: what every patch returns: ``remove()``, ``active``, a ``repr``, ``with``
  support, companions removed with it; what it patched is data (ledger targets and
  :class:`ForwardPatch` entries) that it undoes itself, with the one behaviour below.
- the ledgers: :class:`AttributeLedger` of the attributes patched process-wide (one
  :class:`AttributePatch` per target, reference counted), and :func:`track` / :func:`tracked`, the
  handles acting on one object, keyed weakly by it.
- the instance-forward swap: :func:`swap_forward`, :func:`restore_forward` (a patch on one module
  sets ``module.forward`` as an instance attribute, so the module's type, children and
  ``state_dict`` keys stay as they were).
- unwrapping: :func:`holder_of` finds where code installed after a
  patch holds it (one closure cell of its function, or an instance attribute of a callable object
  such as Accelerate's ``ConvertOutputsToFp32``, at the top or along its ``__wrapped__`` chain, the
  ``functools.wraps`` convention) and re-point that place.

**The one undo behaviour.** A handle undoes exactly what its patch did. ``remove()`` first asks the handle whether its undo
can run: when code installed after the patch wrapped it, the patch is taken
out from under that code where that code holds it in a place that can be found (a closure cell, an
attribute of a callable object, along ``__wrapped__`` chains; see :func:`holder_of`); the
later code stays installed and calls what the patch wrapped. Where it cannot be found, ``remove()``
raises :class:`WrappedByLaterCode` (a ``ValueError``) and changes nothing: restoring the original
would delete the later code. Then the handle's companions (hooks, guards, finalizers that belong to
the same patch) are removed, last added first, and the handle's own undo runs. Removing twice is a
no-op.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import types
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

from torch import nn

__all__ = [
    "Handle", "ForwardPatch", "WrappedByLaterCode", "LOCK", "AttributeLedger", "AttributePatch", "track", "tracked",
    "swap_forward", "restore_forward", "forward_below", "wrapped_forward", "holder_of", "holding_cell",
]


logger = logging.getLogger(__name__)


# --- the handle ------------------------------------------------------------------------------------

#: Held while any handle patches or undoes, so two threads never interleave on one target.
LOCK = threading.RLock()


class WrappedByLaterCode(ValueError):
    """A handle cannot undo its patch: code installed after it holds it in a way that cannot be
    unwrapped. Remove that later patch first, then the handle."""


@dataclasses.dataclass(frozen=True)
class ForwardPatch:
    """An instance ``forward`` a handle installed: ``module`` and ``replacement``, held weakly (a
    handle never keeps a model alive). The replacement says what it replaced as ``previous`` (None:
    the class's forward), and gets ``removed = True`` when a handle takes it off."""

    module: "weakref.ref[nn.Module]"
    replacement: "weakref.ref[Any]"

    @staticmethod
    def of(module: nn.Module, replacement: Any) -> "ForwardPatch":
        return ForwardPatch(weakref.ref(module), weakref.ref(replacement))


class Handle:
    """Undo handle: ``remove()``, a read-only ``active``, a ``repr``, and ``with`` support.

    What a handle patched is data, and this class undoes it (the one behaviour of the module
    docstring): ``targets`` of an :class:`AttributeLedger` (``ledger``), released one reference
    each, and ``forwards`` (:class:`ForwardPatch`). Subclasses add :meth:`_undo` for anything else
    (hooks, finalizers; it runs after the patches are restored) and :meth:`_describe` for the
    ``repr``. ``companions``: handles removed with this one, last added first.
    """

    _removed = False
    # what a subclass that does not call __init__ holds: nothing (its own _undo does the work)
    companions: Sequence["Handle"] = ()
    _forwards: Sequence[ForwardPatch] = ()
    _ledger: Optional["AttributeLedger"] = None
    _targets: Sequence[str] = ()

    def __init__(self, companions: Sequence["Handle"] = (), *, forwards: Sequence[ForwardPatch] = (),
                 ledger: Optional["AttributeLedger"] = None, targets: Sequence[str] = ()) -> None:
        self.companions: list[Handle] = list(companions)
        self._forwards = list(forwards)
        self._ledger, self._targets = ledger, list(targets)

    @property
    def active(self) -> bool:
        """True until :meth:`remove` succeeds."""
        return not self._removed

    def remove(self) -> None:
        """Undo what this handle did (see the module docstring)."""
        with LOCK:
            if not self.active:
                return
            self._check_wrapped()
            for companion in reversed(self.companions):
                companion.remove()
            self._restore()
            self._undo()
            self._removed = True

    def _check_wrapped(self) -> None:
        """Raise :class:`WrappedByLaterCode`, changing nothing, when later code holds a patch of
        this handle where it cannot be found."""
        for patch in self._releasing():
            current = getattr(patch.owner, patch.attribute, None)
            if not patch.live and holder_of(current, patch.replacement) is None:
                raise self._wrapped_error(patch.target, current)
        for fp in self._forwards:
            module, replacement = fp.module(), fp.replacement()
            if module is not None and replacement is not None and not getattr(replacement, "removed", False):
                try:
                    wrapped_forward(module, replacement)
                except LookupError as exc:
                    raise self._wrapped_error(f"{type(module).__name__}.forward", exc.args[0]) from None

    def _releasing(self) -> list["AttributePatch"]:
        """The attribute patches whose last reference this handle holds."""
        if self._ledger is None:
            return []
        return [p for t in self._targets if (p := self._ledger.get(t)) is not None and p.refcount == 1]

    def _restore(self) -> None:
        for target in reversed(self._targets):
            patch = self._ledger.release(target)
            if patch is None:
                continue
            current = getattr(patch.owner, patch.attribute, None)
            if current is patch.replacement:
                setattr(patch.owner, patch.attribute, patch.original)
                logger.info("restored %s", target)
            else:  # the later code stays and now calls the original
                holder_of(current, patch.replacement)(patch.original)
                logger.info("unwrapped %s from under later code", target)
        for fp in reversed(self._forwards):
            module, replacement = fp.module(), fp.replacement()
            if module is None or replacement is None or getattr(replacement, "removed", False):
                continue
            if restore_forward(module, replacement, replacement.previous):
                logger.info("unwrapped %s.forward from under later code", type(module).__name__)
            replacement.removed = True

    def _undo(self) -> None:  # what a subclass undoes besides its attribute and forward patches
        pass

    def _describe(self) -> str:
        raise NotImplementedError

    def _wrapped_error(self, what: str, by: Any = None) -> WrappedByLaterCode:
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


# --- the ledgers -----------------------------------------------------------------------------------

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


# --- unwrapping ------------------------------------------------------------------------------------

def holding_cell(top: Any, ours: Any) -> Any:
    """The one closure cell of ``top``'s function that holds ``ours`` (code installed after
    ``ours`` that calls it), or None when ``top`` holds it in no cell or in several."""
    function = getattr(top, "__func__", top)
    cells = [c for c in (getattr(function, "__closure__", None) or ()) if _holds(c, ours)]
    return cells[0] if len(cells) == 1 else None


#: How far :func:`holder_of` follows a ``__wrapped__`` chain before giving up.
MAX_CHAIN = 32


def holder_of(top: Any, ours: Any) -> Optional[Callable[[Any], None]]:
    """Where code installed after ``ours`` holds it, as a function that re-points that place:
    ``holder_of(top, ours)(below)`` makes the chain call ``below`` instead of ``ours``. None when
    the chain holds ``ours`` in no place this can find, or ambiguously, or a link is not callable.

    Follows ``top``, then each ``__wrapped__`` below it (the ``functools.wraps`` convention: a
    wrapper that sets it calls what it names), and stops at the first link that holds ``ours``:
    in one closure cell of its function, or in instance attributes (a callable object that keeps
    the function it calls, such as Accelerate's ``ConvertOutputsToFp32``). That link's
    ``__wrapped__`` is re-pointed too, so the chain still reads as what it calls. A link that names
    ``ours`` only as its ``__wrapped__`` holds it in no place found, so None."""
    node, seen = top, set()
    while node is not None and node is not ours and id(node) not in seen and len(seen) < MAX_CHAIN:
        seen.add(id(node))
        if not callable(node):  # not a link of a call chain: what it holds is not called through it
            return None
        function = getattr(node, "__func__", node)
        cell = holding_cell(function, ours)
        names = [k for k, v in _attributes(node) if v is ours and k != "__wrapped__"]
        if cell is not None or names:
            def repoint(below: Any, node: Any = node, cell: Any = cell, names: list = names) -> None:
                if cell is not None:
                    cell.cell_contents = below
                for name in names:
                    setattr(node, name, below)
                if getattr(node, "__wrapped__", None) is ours:
                    _set_wrapped(node, below)
            return repoint
        node = getattr(node, "__wrapped__", None)
    return None


def _attributes(node: Any) -> list[tuple[str, Any]]:
    """``node``'s instance attributes (``vars``); none when it has no ``__dict__``."""
    try:
        return list(vars(node).items())
    except TypeError:  # no __dict__
        return []


def _set_wrapped(node: Any, below: Any) -> None:
    try:
        setattr(getattr(node, "__func__", node), "__wrapped__", below)
    except (AttributeError, TypeError):
        pass


def _holds(cell: Any, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


# --- the instance-forward swap ---------------------------------------------------------------------

def swap_forward(module: nn.Module, replacement: Callable[..., Any]) -> Optional[Callable[..., Any]]:
    """Install ``replacement`` as ``module``'s instance ``forward``; return the instance forward it
    replaced (None when the class's forward was in use)."""
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = replacement
    return previous


def forward_below(module: nn.Module, previous: Optional[Callable[..., Any]]) -> Callable[..., Any]:
    """What a swapped-in forward calls: ``previous``, else the class's forward bound to ``module``."""
    return previous if previous is not None else types.MethodType(type(module).forward, module)


def wrapped_forward(module: nn.Module, replacement: Any) -> Optional[Callable[[Any], None]]:
    """None when ``module``'s forward is ``replacement`` itself; else where the code installed
    since holds ``replacement`` (see :func:`holder_of`), or raises LookupError
    when it cannot be found."""
    top = module.__dict__.get("forward")
    if top is replacement:
        return None
    repoint = holder_of(top, replacement)
    if repoint is None:
        raise LookupError(top)
    return repoint


def restore_forward(module: nn.Module, replacement: Any, previous: Optional[Callable[..., Any]]) -> bool:
    """Undo :func:`swap_forward`: put ``previous`` back (or the class's forward), or, when code
    installed since wrapped ``replacement``, re-point that code at what ``replacement`` wrapped and
    also every attribute of ``module`` that names ``replacement`` (Accelerate keeps the forward it
    wrapped as ``_original_forward``). Returns True when it unwrapped from under later code.

    Call :func:`wrapped_forward` first (as ``Handle.remove`` does): this assumes it did not raise.
    """
    repoint = wrapped_forward(module, replacement)
    if repoint is None:
        if previous is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = previous
        return False
    below = forward_below(module, previous)
    repoint(below)
    for name, value in list(vars(module).items()):
        if value is replacement:
            setattr(module, name, below)
    return True
