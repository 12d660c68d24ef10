"""Reading and replacing the arguments of a call, however the caller passed them.

A replacement must read and replace the arguments of a call by position or by keyword, under an
old or a new name (``"cache"`` was ``"past_key_values"`` before Transformers 5.24):
:func:`argument` reads one argument by name (aliases allowed; ``params`` from
:func:`model_patches.targets.parameters`);
:func:`mask_arguments` the first three of a Transformers mask function; :func:`with_arguments`
returns the call with some arguments replaced.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["argument", "mask_arguments", "with_arguments"]

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
