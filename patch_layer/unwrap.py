"""Unwrapping: where code installed after a patch holds it, and how to re-point that place.

A patch that someone wrapped since (a trainer wrapping a model's forward, another library wrapping
a patched function) can be taken out from under that code when the code holds the patch in a
place that can be found: one closure cell of its function, or an instance attribute of a callable
object (Accelerate's ``ConvertOutputsToFp32``), at ``top`` or along its ``__wrapped__`` chain (the
``functools.wraps`` convention).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["holding_cell", "holder_of", "unwrap_from_under", "MAX_CHAIN"]


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


def unwrap_from_under(top: Any, ours: Any, below: Any) -> bool:
    """Take ``ours`` out of a call chain in which ``top`` (code installed after ``ours``) calls it,
    directly or through further wrappers (see :func:`holder_of`): point the place that holds
    ``ours`` at ``below`` (what ``ours`` wrapped) and return True; ``top`` keeps working and now
    calls ``below``. False, with nothing changed, when ``ours`` is held some other way (then it
    cannot be unwrapped)."""
    repoint = holder_of(top, ours)
    if repoint is None:
        return False
    repoint(below)
    return True


def _holds(cell: Any, value: Any) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
