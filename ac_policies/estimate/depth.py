"""Estimates of a deep model from two shallow copies of it: the decoder's repeating period.

A decoder is a prefix of blocks (DeepSeek's first dense layers) followed by a pattern that
repeats (one block for Llama; sliding and full attention in turn for GPT-OSS; three linear
attention layers and one full for Qwen3-Next). Every byte count of a step is, to a very good
approximation, linear in the number of repeats: parameters, gradients and optimizer state are
per block, the activations a checkpointed block keeps are per block, and the transient peak of one
block's recompute does not depend on how many blocks there are. So a step at full depth is
estimated from the same model cut to ``prefix + 2 * period`` and ``prefix + 3 * period`` blocks,
each traced on fake tensors, and extrapolated: what the long-context search needs to stay fast on an
8B model. The optimizer step is the exception: its peak is the largest of many per-op lines (a
foreach AdamW's temporaries), so the search takes it from one full-depth trace at a short length
(it does not depend on the length: activations are gone by then) through :func:`with_phase_peak`. :func:`reduced_depth` cuts the model in place for the duration of a block (the decoder's
block list and its config's layer count) and puts everything back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional

from torch import nn

from ..structure import is_decoder_block, planning
from .result import MemoryEstimate

__all__ = ["DecoderLayout", "decoder_layout", "reduced_depth", "extrapolate", "estimate_at_depth", "with_phase_peak"]


@dataclasses.dataclass(frozen=True)
class DecoderLayout:
    """Where the blocks are and how they repeat: ``owner.<attr>`` is the ``nn.ModuleList`` of
    ``count`` blocks, the first ``prefix`` of which are not part of the ``period``-block pattern."""

    owner: nn.Module
    attr: str
    count: int
    prefix: int
    period: int

    @property
    def reducible(self) -> bool:
        """Whether the two shallow copies (two and three periods) are smaller than the model (else
        estimate it whole)."""
        return self.prefix + 3 * self.period < self.count


def _signature(block: nn.Module) -> tuple:
    kids = tuple((name, type(child).__name__) for name, child in block.named_children())
    attention = getattr(block, "attention_type", None) or getattr(block, "layer_type", None)
    window = next((getattr(m, "sliding_window", None) for m in block.modules() if getattr(m, "sliding_window", None)), None)
    return type(block).__name__, kids, attention, window


def _pattern(signatures: list[tuple]) -> tuple[int, int]:
    """The shortest ``(prefix, period)`` with ``signatures[prefix:]`` periodic, favouring short prefixes."""
    n = len(signatures)
    best = (n, 1)
    for prefix in range(n):
        tail = signatures[prefix:]
        for period in range(1, len(tail) + 1):
            if all(tail[i] == tail[i % period] for i in range(len(tail))):
                if prefix + 2 * period < best[0] + 2 * best[1]:
                    best = (prefix, period)
                break
    return best


def decoder_layout(model: nn.Module) -> Optional[DecoderLayout]:
    """The layout of ``model``'s decoder blocks, or None when no ``nn.ModuleList`` holds only blocks."""
    with planning(model):
        for fqn, module in model.named_modules():
            if isinstance(module, nn.ModuleList) and len(module) and all(
                    is_decoder_block(f"{fqn}.{i}", block) for i, block in enumerate(module)):
                owner_name, _, attr = fqn.rpartition(".")
                prefix, period = _pattern([_signature(b) for b in module])
                return DecoderLayout(model.get_submodule(owner_name), attr, len(module), prefix, period)
    return None


def _configs(model: nn.Module) -> list[Any]:
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        found.append(text)
    return [c for c in found if hasattr(c, "num_hidden_layers")]


@contextlib.contextmanager
def reduced_depth(model: nn.Module, layout: DecoderLayout, blocks: int) -> Iterator[None]:
    """``model`` with only its first ``blocks`` decoder blocks (and its config saying so) inside."""
    full = getattr(layout.owner, layout.attr)
    configs = _configs(model)
    counts = [c.num_hidden_layers for c in configs]
    setattr(layout.owner, layout.attr, nn.ModuleList(list(full)[:blocks]))
    for c in configs:
        c.num_hidden_layers = blocks
    try:
        yield
    finally:
        setattr(layout.owner, layout.attr, full)
        for c, n in zip(configs, counts):
            c.num_hidden_layers = n


_LINEAR = ("params", "buffers", "grads", "optimizer", "activations", "peak")


def _line(a: float, b: float, repeats: float) -> int:
    return int(round(a + (repeats - 1) * (b - a)))


def extrapolate(one: MemoryEstimate, two: MemoryEstimate, repeats: float, first: int = 2) -> MemoryEstimate:
    """The estimate at ``repeats`` periods from those at ``first`` and ``first + 1`` periods: every
    byte count linear in the number of periods, each phase's peak on its own line and the step's
    peak the largest of them (the phase holding the peak can change with depth: the optimizer's
    temporaries grow with the blocks, a loss's logits do not); the module of the peak is the deeper
    one's. Two periods at least: with one, the first block has no neighbour (no prefetched next
    unit under FSDP2), and that difference would be taken for growth."""
    values = {k: _line(getattr(one, k), getattr(two, k), repeats - first + 1) for k in _LINEAR}
    values["workspace"] = max(one.workspace, two.workspace)
    before, after = dict(one.phase_peaks), dict(two.phase_peaks)
    if before and before.keys() == after.keys():
        phases = tuple((p, _line(before[p], after[p], repeats - first + 1)) for p in after)
        phase, peak = max(phases, key=lambda item: item[1])
        values["peak"] = peak
        values["phase_peaks"] = phases
        if phase != two.peak_phase:
            values["peak_phase"], values["peak_module"] = phase, ""
    return dataclasses.replace(two, **values,
                               note=f"extrapolated to {repeats:g} periods of blocks from {first} and {first + 1}")


def with_phase_peak(e: MemoryEstimate, phase: str, peak: int) -> MemoryEstimate:
    """``e`` with ``phase``'s peak replaced by ``peak`` (the step's peak and its phase follow)."""
    phases = tuple((p, peak if p == phase else v) for p, v in e.phase_peaks) or ((phase, peak),)
    top_phase, top = max(phases, key=lambda item: item[1])
    module = e.peak_module if top_phase == e.peak_phase else ""
    return dataclasses.replace(e, phase_peaks=phases, peak=top, peak_phase=top_phase, peak_module=module)


def estimate_at_depth(model: nn.Module, run: Callable[[], MemoryEstimate], layout: Optional[DecoderLayout]) -> MemoryEstimate:
    """``run()`` (an estimate of ``model``) at full depth, extrapolated from two shallow copies
    when the layout allows it, else run whole."""
    if layout is None or not layout.reducible:
        return run()
    with reduced_depth(model, layout, layout.prefix + 2 * layout.period):
        two = run()
    with reduced_depth(model, layout, layout.prefix + 3 * layout.period):
        three = run()
    return extrapolate(two, three, (layout.count - layout.prefix) / layout.period)
