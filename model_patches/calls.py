"""Call introspection shared by every patch: parameters, arguments, liveness, imported modules.

A replacement must read and replace the arguments of a call however the caller passed them
(by position or by keyword, under an old or a new name), and decide from signatures whether a
target still has the shape it was written for. Everything of that kind lives here:

- :func:`parameters` of a function; :func:`argument` reads one argument of a call by name
  (aliases allowed: ``"cache"`` was ``"past_key_values"`` before Transformers 5.24);
  :func:`with_arguments` returns the call with some arguments replaced.
- :func:`parameters_probe`: the signature probe of every record (first parameters, required
  ones); :func:`mask_arguments_probe` for Transformers' mask functions, which all start
  ``(config, inputs_embeds, attention_mask, ...)`` (``input_embeds`` in some).
- :func:`is_live`: whether a wrapper is still what its target holds (a module that imported a
  wrapper while a patch was on must fall back to the original once it is removed).
- :func:`model_modules`: the Transformers model modules imported in this process
  (``transformers.models.<family>.modeling_<family>``), optionally only those holding a name.
- :func:`unwrapped`: the object a wrapper of this package replaced (``_packing_original``).
- :func:`holder_of` / :func:`unwrap_from_under`: take a patch out from under code that wrapped it
  since (closure cells, callable objects, along ``__wrapped__`` chains).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional, Sequence

__all__ = [
    "holding_cell",
    "holder_of",
    "unwrap_from_under",
    "parameters",
    "argument",
    "mask_arguments",
    "with_arguments",
    "parameters_probe",
    "mask_arguments_probe",
    "is_live",
    "model_modules",
    "unwrapped",
]

#: The first three parameters of every Transformers mask function (4.53+; ``input_embeds`` in some).
MASK_PARAMETERS = (["config", "inputs_embeds", "attention_mask"], ["config", "input_embeds", "attention_mask"])


def parameters(fn: Any) -> list[str]:
    """The parameter names of ``fn`` in order (``self`` included for a plain function)."""
    return list(inspect.signature(fn).parameters)


def argument(args: Sequence[Any], kwargs: dict[str, Any], params: Sequence[str], *names: str) -> Any:
    """The argument passed for the first of ``names`` (aliases of one parameter), else None.

    A keyword under any alias wins; otherwise the positional argument at the parameter's index
    (the first alias found in ``params``).
    """
    for name in names:
        if name in kwargs:
            return kwargs[name]
    for name in names:
        if name in params:
            index = params.index(name)
            return args[index] if index < len(args) else None
    return None


def mask_arguments(args: Sequence[Any], kwargs: dict[str, Any], params: Sequence[str]) -> tuple[Any, Any, Any]:
    """``(attention_mask, config, inputs_embeds)`` of a call to a Transformers mask function."""
    return (
        argument(args, kwargs, params, "attention_mask"),
        argument(args, kwargs, params, "config"),
        argument(args, kwargs, params, "inputs_embeds", "input_embeds"),
    )


def with_arguments(args: Sequence[Any], kwargs: dict[str, Any], params: Sequence[str],
                   **values: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with each ``name=value`` put where the caller passed that parameter
    (its position when given positionally, else as a keyword); the inputs are not changed."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for name, value in values.items():
        index = params.index(name) if name in params else len(new_args)
        if name not in new_kwargs and index < len(new_args):
            new_args[index] = value
        else:
            new_kwargs[name] = value
    return tuple(new_args), new_kwargs


def parameters_probe(fn: Any, first: Sequence[str] = (), required: Sequence[str] = ()) -> Optional[str]:
    """Probe: ``fn``'s parameters start with ``first`` and include every name of ``required``
    (None), else why not (a signature that cannot be read is a reason too)."""
    try:
        params = parameters(fn)
    except (TypeError, ValueError) as exc:
        return f"cannot read its signature ({exc})"
    if params[: len(first)] != list(first):
        return f"expected parameters ({', '.join(first)}, ...), found {params}"
    missing = [name for name in required if name not in params]
    if missing:
        return f"no {' / '.join(repr(m) for m in missing)} parameter (found {params})"
    return None


def mask_arguments_probe(fn: Any) -> Optional[str]:
    """Probe: ``fn`` takes ``(config, inputs_embeds, attention_mask, ...)`` (None), else why not."""
    params = parameters(fn)
    if params[:3] not in MASK_PARAMETERS:
        return f"expected parameters (config, inputs_embeds, attention_mask, ...), found {params[:3]}"
    return None


def is_live(target: str, wrapper: Callable) -> bool:
    """Whether ``target`` (``"module:attribute"``) holds ``wrapper`` now."""
    module_name, _, attr = target.partition(":")
    module = sys.modules.get(module_name)
    return module is not None and getattr(module, attr, None) is wrapper


def unwrapped(value: Any) -> Any:
    """The original behind a wrapper of this package, else ``value`` itself."""
    return getattr(value, "_packing_original", value)


def model_modules(holding: Optional[Callable[[dict[str, Any]], bool]] = None) -> list[str]:
    """Sorted names of the imported ``transformers.models.*.modeling_*`` modules (whose namespace
    satisfies ``holding``, when given)."""
    return sorted(
        name for name, module in list(sys.modules.items())
        if name.startswith("transformers.models.") and ".modeling_" in name and module is not None
        and (holding is None or holding(getattr(module, "__dict__", {})))
    )


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
