"""Peak memory and wall time of each phase of a training step, inside a ``Trainer`` run.

Phases: ``forward`` (forward and loss: around ``Trainer.compute_loss``), ``backward`` (the end
of the loss to ``on_pre_optimizer_step``: backward and the gradient-norm clip) and
``optimizer`` (``on_pre_optimizer_step`` to ``on_optimizer_step``).

Baseline: taken at the start of every step (:meth:`PhaseMeter.step_begin`): model, optimizer
state (from the second step on), no gradients (``Trainer`` sets them to None after each
optimizer step). The first step is a warm-up: it creates AdamW's state and whatever the process
keeps from a first call (compiled graphs, caches), so the figures come from the later steps,
each measured above its own start. Every phase's peak is measured above that baseline:

- CPU: the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` at
  each phase start) minus the resident set at the baseline. The process runs with glibc's mmap
  threshold at 64 KiB (:mod:`bench.harness.isolated`), so freed buffers leave the resident set.
- CUDA: ``torch.cuda.max_memory_allocated()`` (reset at each phase start) minus what was
  allocated at the baseline, and ``max_memory_reserved()`` (the caching allocator's pool; absolute).

At each phase's end it also records what stays (resident set or allocated bytes minus the
baseline): after ``forward`` that is what the step keeps for backward.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Optional

import torch

from bench.harness.rss import reset_peak_rss, rss_bytes

PHASES = ("forward", "backward", "optimizer")
MIB = 2**20


class PhaseMeter:
    """Per step and phase: peak above the baseline, bytes held at the phase's end, seconds."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.baseline: Optional[int] = None
        self.baseline_reserved: Optional[int] = None
        self.steps: list[dict[str, Any]] = []
        self._phase: Optional[str] = None
        self._t0 = 0.0
        self._step_t0 = 0.0

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _now_bytes(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else rss_bytes("VmRSS")

    def _set_baseline(self) -> None:
        gc.collect()
        self._sync()
        if self.cuda:
            self.baseline = torch.cuda.memory_allocated()
            self.baseline_reserved = torch.cuda.memory_reserved()
        else:
            reset_peak_rss()
            self.baseline = rss_bytes("VmHWM")  # right after the reset: the resident set now

    def step_begin(self) -> None:
        """A step starts: its baseline is the memory now (model, optimizer state, no gradients)."""
        self._set_baseline()
        self.steps.append({"phases": {}})
        self._step_t0 = time.perf_counter()

    def start(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()
        self._phase, self._t0 = phase, time.perf_counter()

    def stop(self, phase: str) -> None:
        if self._phase != phase:
            raise RuntimeError(f"phase {phase!r} stopped while {self._phase!r} was running")
        self._sync()
        seconds = time.perf_counter() - self._t0
        base = self.baseline or 0
        if self.cuda:
            peak = torch.cuda.max_memory_allocated() - base
            reserved = torch.cuda.max_memory_reserved()
        else:
            peak, reserved = rss_bytes("VmHWM") - base, None
        self.steps[-1]["phases"][phase] = {"peak": peak, "held": self._now_bytes() - base, "seconds": seconds,
                                           "reserved": reserved}
        self._phase = None

    def step_end(self, loss: float, real_tokens: int, scored_tokens: int, grad_bytes: int, slots: int = 0) -> None:
        """A step ends: its loss, real (non-padding) and scored tokens, gradient bytes and row slots."""
        self._sync()
        step = self.steps[-1]
        step.update(seconds=time.perf_counter() - self._step_t0, loss=loss, real_tokens=real_tokens,
                    scored_tokens=scored_tokens, grad_bytes=grad_bytes, slots=slots)


def summarize(steps: list[dict[str, Any]], static: dict[str, int]) -> dict[str, Any]:
    """The run's figures from its steps: the first step is a warm-up (it creates the optimizer
    state), kept only when it is the only one.

    Returns peak above the baseline per phase (max over the measured steps), the step peak and
    its phase, the peak above the static state (parameters + gradients + optimizer state:
    ``peak - gradient bytes``, since each step's baseline holds parameters and optimizer state), the
    bytes kept after forward, losses per step and real tokens per second.
    """
    measured = steps[1:] or steps
    phases = {}
    for name in PHASES:
        runs = [s["phases"][name] for s in measured if name in s["phases"]]
        if runs:
            worst = max(runs, key=lambda r: r["peak"])
            phases[name] = {"peak": worst["peak"], "held": worst["held"], "reserved": worst["reserved"],
                            "seconds": sum(r["seconds"] for r in runs) / len(runs)}
    peak_phase = max(phases, key=lambda p: phases[p]["peak"]) if phases else None
    peak = phases[peak_phase]["peak"] if peak_phase else None
    seconds = sum(s["seconds"] for s in measured)
    tokens = sum(s["real_tokens"] for s in measured)
    return {
        "losses": [s["loss"] for s in steps],
        "phases": phases,
        "peak": peak,
        "peak_phase": peak_phase,
        "peak_above_static": None if peak is None else peak - static["grads"],
        "kept_after_forward": phases.get("forward", {}).get("held"),
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "step_seconds": seconds / len(measured) if measured else None,
        "real_tokens": [s["real_tokens"] for s in steps],
        "scored_tokens": [s["scored_tokens"] for s in steps],
        "slots": [s.get("slots", 0) for s in steps],
    }


def phase_peaks(result: dict[str, Any]) -> str:
    """``"fwd / bwd / opt"`` peaks above the step's start, MiB, of a run's :func:`summarize` figures."""
    ph = result.get("phases") or {}
    return " / ".join(f"{ph[p]['peak'] / MIB:.0f}" if p in ph else "-" for p in PHASES)


def what_holds(result: dict[str, Any]) -> str:
    """What holds a run's step peak, in words, from its phase figures (:func:`summarize` plus ``static``)."""
    phase = result.get("peak_phase")
    if phase is None:
        return "-"
    grads = result["static"]["grads"] / MIB
    peak = result["phases"][phase]["peak"] / MIB
    kept = (result.get("kept_after_forward") or 0) / MIB
    if phase == "forward":
        return f"forward: activations kept for backward ({kept:.0f} MiB at its end) + loss transients"
    if phase == "backward":
        return (f"backward: gradients ({grads:.0f} MiB) + {peak - grads:.0f} MiB of activations, their gradients "
                f"and transients ({kept:.0f} MiB kept from forward)")
    return f"optimizer step: gradients ({grads:.0f} MiB) + {peak - grads:.0f} MiB of AdamW/clip temporaries"
