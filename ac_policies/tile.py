"""``tile``: run a position-wise module over slices of its tokens, one checkpoint region per slice.

A module is *position-wise* when each token's output depends on that token's input alone: a
dense MLP, a MoE block (routing is per token), a norm. Run whole, its backward keeps every
intermediate of every token (three or four ``[tokens, intermediate]`` tensors for a gated MLP);
tiled, forward keeps only each slice's input, and backward recomputes one slice at a time, the
last first, freeing it before the next. The input is viewed as one row of tokens (``[B, T, H]``
as ``[1, B*T, H]``), so slices cross batch rows and the outputs come back in the module's own
order.

Exactness: each slice runs the module's own forward on its tokens, so the outputs are those of
the untiled module, and each parameter's gradient is the sum over slices, accumulated by autograd
into one gradient before its ``AccumulateGrad`` runs: hooks on parameter gradients (DDP, FSDP2's
reduce-scatter, DeepSpeed ZeRO) fire once per step, not once per tile. Outputs that are per token
(the same leading shape as the input slice, or one row per token such as a router's
``[tokens, experts]`` logits) are concatenated; a MoE router's outputs recorded by Transformers'
output capturing (``output_router_logits``) are merged back to one entry per layer, so the
auxiliary loss sees the whole sequence's routing. RNG state is preserved per slice, as
checkpointing preserves it.

``tiles="auto"`` takes slices of about ``hidden`` tokens (DeepSpeed's ``TiledMLP`` rule,
``ceil(tokens / hidden)``), rounded so that every slice holds at least ``max(hidden, 1024)`` tokens:
``tokens // max(hidden, 1024)`` slices. A sequence shorter than two such slices is not tiled: its
intermediates are small next to the rest of the step, and a tile costs one more forward of the
module in backward.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .seam import recorded_outputs
from .structure import is_attention, is_decoder_block, is_linear_attention

__all__ = ["TILES_AUTO", "Tiles", "auto_tiles", "check_tiles", "not_position_wise", "tile_count", "tiled_call"]

TILES_AUTO = "auto"
Tiles = Union[int, str]


def check_tiles(value: Any) -> Tiles:
    """``value`` as a tile count: an int >= 1 or ``"auto"``; anything else raises."""
    if isinstance(value, str) and value.strip().lower() == TILES_AUTO:
        return TILES_AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"tiles must be a positive int or 'auto', got {value!r}")
    return value


#: The fewest tokens an ``"auto"`` slice holds: below that a slice's intermediates are small next to
#: everything else a step holds, and each slice costs a region and its kernels' launches.
MIN_AUTO_SLICE = 1024


def auto_tiles(tokens: int, hidden: int) -> int:
    """Slices of about ``hidden`` tokens (DeepSpeed's ``TiledMLP`` rule, ``ceil(tokens / hidden)``),
    each at least ``max(hidden, MIN_AUTO_SLICE)`` tokens (narrow models would otherwise get a slice
    per few tokens): ``tokens // max(hidden, MIN_AUTO_SLICE)``, at least 1."""
    return max(1, tokens // max(MIN_AUTO_SLICE, hidden))


def tile_count(tiles: Tiles, tokens: int, hidden: int) -> int:
    """The number of slices for ``tokens`` tokens of width ``hidden``: ``tiles`` (or the auto
    rule), at most ``tokens``."""
    n = auto_tiles(tokens, hidden) if tiles == TILES_AUTO else int(tiles)
    return max(1, min(n, tokens))


def not_position_wise(fqn: str, module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot be tiled, or None when its structure is position-wise.

    Refused: a decoder block, softmax attention or a linear-attention mixer (or a module holding
    one): tokens see other tokens there, so a slice alone gives another result.
    """
    for name, sub in module.named_modules():
        where = f"{fqn}.{name}" if name and fqn else (name or fqn or "<root>")
        for test, kind in ((is_decoder_block, "a decoder block"), (is_attention, "attention"),
                           (is_linear_attention, "a linear-attention mixer")):
            if test(where, sub):
                return (f"{where} ({type(sub).__name__}) is {kind}: its tokens attend to other tokens, so a "
                        "slice of the sequence alone does not give the same output; tile only position-wise "
                        "modules (dense MLPs, MoE blocks)")
        if isinstance(sub, (nn.Conv1d, nn.Conv2d)):
            return (f"{where} holds a convolution ({type(sub).__name__}): it mixes neighbouring tokens, so "
                    "the module is not position-wise")
    return None


def _tensor_input(fqn: str, args: tuple, kwargs: dict) -> tuple[str, Union[int, str]]:
    """Where the one tensor argument is: ("arg", index) or ("kw", name)."""
    found = [("arg", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    found += [("kw", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if len(found) != 1:
        raise ValueError(
            f"ac_policies: 'tile' on {fqn or '<root>'}: the module was called with {len(found)} tensor arguments; "
            "a tiled module takes one (the tokens' hidden states), as position-wise modules do. Tile the "
            "module that takes only the hidden states"
        )
    return found[0]


def _merge(parts: list[Any], sizes: list[int], fqn: str, what: str) -> Any:
    """One output from the slices' outputs: tensors concatenated along their token dimension."""
    first = parts[0]
    if first is None:
        return None
    if isinstance(first, (tuple, list)):
        merged = [_merge([p[i] for p in parts], sizes, fqn, f"{what}[{i}]") for i in range(len(first))]
        return type(first)(merged)
    if not isinstance(first, torch.Tensor):
        raise ValueError(f"ac_policies: 'tile' on {fqn or '<root>'}: {what} is a {type(first).__name__}, "
                         "not a tensor per token; only per-token outputs can be put back together")
    # [1, t, ...] (the slice's own layout) or [t, ...] (one row per token)
    dim = 1 if first.dim() >= 2 and first.shape[0] == 1 and all(p.shape[1] == s for p, s in zip(parts, sizes)) else 0
    if not all(p.dim() > dim and p.shape[dim] == s for p, s in zip(parts, sizes)):
        raise ValueError(
            f"ac_policies: 'tile' on {fqn or '<root>'}: {what} has shape {tuple(first.shape)} for a slice of "
            f"{sizes[0]} tokens: it is not one value per token, so the module is not position-wise"
        )
    return torch.cat(parts, dim)


def _recorded_lengths() -> Optional[dict[str, int]]:
    collected = recorded_outputs()
    if collected is None:
        return None
    return {k: len(v) for k, v in collected.items() if isinstance(v, list)}


def _merge_recorded(before: Optional[dict[str, int]], sizes: list[int], fqn: str) -> None:
    """Put the outputs Transformers recorded from inside the slices back as one entry per call of
    the whole module (a MoE router's logits: one ``[tokens, experts]`` per layer)."""
    collected = recorded_outputs()
    if before is None or collected is None:
        return
    n = len(sizes)
    for key, start in before.items():
        entries = collected[key][start:]
        if not entries:
            continue
        if len(entries) % n:
            raise ValueError(
                f"ac_policies: 'tile' on {fqn or '<root>'}: Transformers recorded {len(entries)} '{key}' outputs "
                f"over {n} slices, not a whole number per slice; the module is not position-wise"
            )
        per = len(entries) // n
        merged = [_merge([entries[t * per + j] for t in range(n)], sizes, fqn, f"recorded {key!r}") for j in range(per)]
        collected[key][start:] = merged


def tiled_call(fqn: str, tiles: Tiles, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``call(*args, **kwargs)`` over slices of the tokens of its one tensor argument.

    ``call`` is the module's forward (bound). The tensor argument is ``[..., H]``: its leading
    dimensions are the tokens, taken in order as one row (``[1, N, H]`` for a 3-D input, ``[N, H]``
    for a 2-D one). Each slice runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
    preserve_rng_state=True)``; per-token outputs are concatenated and given the input's leading
    shape back.
    """
    kind, where = _tensor_input(fqn, args, kwargs)
    x = args[where] if kind == "arg" else kwargs[where]  # type: ignore[index]
    if x.dim() < 2:
        raise ValueError(f"ac_policies: 'tile' on {fqn or '<root>'}: the input has shape {tuple(x.shape)}; "
                         "expected [..., tokens, hidden]")
    lead, hidden = tuple(x.shape[:-1]), x.shape[-1]
    tokens = math.prod(lead)
    n = tile_count(tiles, tokens, hidden)
    if n == 1:
        return call(*args, **kwargs)
    row = x.reshape(1, tokens, hidden) if x.dim() >= 3 else x
    token_dim = row.dim() - 2
    size = -(-tokens // n)
    slices = row.split(size, dim=token_dim)
    sizes = [s.shape[token_dim] for s in slices]

    # the slices' regions keep ``run`` until backward: it must not hold the whole input
    head, tail = (args[:where], args[where + 1:]) if kind == "arg" else (args, ())  # type: ignore[misc,operator]
    others = {k: v for k, v in kwargs.items() if k != where}

    def run(piece: torch.Tensor) -> Any:
        if kind == "arg":
            return call(*head, piece, *tail, **others)
        return call(*head, **others, **{where: piece})

    before = _recorded_lengths()
    outs = [checkpoint(run, piece, use_reentrant=False, preserve_rng_state=True) for piece in slices]
    _merge_recorded(before, sizes, fqn)
    merged = _merge(outs, sizes, fqn, "the output")
    return _restore_shape(merged, row, lead)


def _restore_shape(out: Any, row: torch.Tensor, lead: tuple) -> Any:
    """Outputs in the slice's layout (``[1, N, ...]``) get the input's leading shape back."""
    if isinstance(out, (tuple, list)):
        return type(out)(_restore_shape(o, row, lead) for o in out)
    if isinstance(out, torch.Tensor) and row.dim() == 3 and out.dim() >= 2 and out.shape[0] == 1 and out.shape[1] == row.shape[1]:
        return out.reshape(*lead, *out.shape[2:])
    return out

