"""The dtype a bench section runs in when no flag names one: the one this host computes fast.

The quick run must fit its few minutes on any machine, and a bf16 matmul is fast only where the
hardware multiplies bf16 natively: on CUDA (tensor cores) and on CPUs with bf16 matrix
instructions (AVX512_BF16, AMX_BF16). Elsewhere, an AVX2-only CPU for one, torch runs bf16
matmuls through a slow fallback, 100x slower than fp32 or worse (0.3 against 81 GFLOP/s on a 2-core
AVX2 EPYC, bench/RESULTS.md), and the quick run would take an hour. So:

  - on CUDA (and any other accelerator): bf16;
  - on a CPU with bf16 matrix units: bf16;
  - on any other CPU: fp32 for a section with matmuls; bf16 for one without (element-wise
    bf16, converted to fp32 in registers, runs about as fast as fp32 on any vector unit).

A CPU that is not recognised falls back to fp32: a wrong fp32 costs at most the bf16 speed-up, a
wrong bf16 can cost 100x. An explicit flag always wins: a section's own (``--ce-dtype``...), then
``--dtype`` for every section. Each choice carries a one-line reason for the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Optional

import torch

#: The dtypes a section can run in, by their flag names.
DTYPE_NAMES = ("bf16", "fp16", "fp32")
#: Capabilities (see :func:`host_capability`) whose CPUs multiply bf16 matrices natively.
BF16_MATRIX_CAPABILITIES = frozenset({"AMX_BF16", "AVX512_BF16"})
#: /proc/cpuinfo flags -> the capability they stand for, strongest first.
_BF16_FLAGS = (("amx_bf16", "AMX_BF16"), ("avx512_bf16", "AVX512_BF16"))


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """A section's dtype (``"bf16"``, ``"fp16"`` or ``"fp32"``) and why it was picked."""

    dtype: str
    reason: str

    def __str__(self) -> str:
        return f"{self.dtype}: {self.reason}"

    def to_json(self) -> dict[str, str]:
        return {"dtype": self.dtype, "reason": self.reason}


def _cpuinfo_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _torch_flags() -> frozenset[str]:
    """The bf16 matrix features torch's own CPU probe reports, as ``/proc/cpuinfo`` names them."""
    # every CPU with AMX tiles so far has AMX-BF16 (Sapphire Rapids and later)
    probes = (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported"))
    flags = set()
    for flag, name in probes:
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                flags.add(flag)
        except RuntimeError:  # a build without the probe's backend
            continue
    return frozenset(flags)


@functools.lru_cache(maxsize=1)
def host_capability() -> str:
    """This CPU's capability: ``"AMX_BF16"`` or ``"AVX512_BF16"`` where it has bf16 matrix
    instructions, else ``torch.backends.cpu.get_cpu_capability()`` (``"AVX512"``, ``"AVX2"``,
    ``"SVE256"``, ``"DEFAULT"``...), which names the vector width only, never bf16 support."""
    flags = _cpuinfo_flags() | _torch_flags()
    for flag, capability in _BF16_FLAGS:
        if flag in flags:
            return capability
    return torch.backends.cpu.get_cpu_capability()


def default_dtype(device: str, capability: Optional[str] = None, *, matmuls: bool = True) -> DtypeChoice:
    """The dtype a section runs in on ``device`` when no flag names one, and why.

    ``capability`` is the CPU's (see :func:`host_capability`; this host's when None, and only
    read on CPU); ``matmuls`` says whether the section's step multiplies bf16 matrices (a section
    on logits alone does not). Raises ``TypeError`` for a ``device`` that is not a string.
    """
    if not isinstance(device, str):
        raise TypeError(f"device must be a device string such as 'cpu' or 'cuda', got {device!r}")
    if not device.startswith("cpu"):
        kind = "tensor cores" if device.startswith("cuda") else "the accelerator"
        return DtypeChoice("bf16", f"{device} runs bf16 matmuls on {kind}")
    capability = host_capability() if capability is None else capability
    if not matmuls:
        return DtypeChoice("bf16", "this step has no matmuls, and element-wise bf16 runs about as fast as "
                                   f"fp32 on any CPU (this one: {capability})")
    if capability.upper() in BF16_MATRIX_CAPABILITIES:
        return DtypeChoice("bf16", f"this CPU ({capability.upper()}) has bf16 matrix units")
    return DtypeChoice("fp32", f"this CPU ({capability}) has no bf16 matrix units: bf16 matmuls can run "
                               "100x slower than fp32 there")


def flag_attribute(flag: str) -> str:
    """``"--ce-dtype"`` -> ``"ce_dtype"``, the attribute argparse stores it under."""
    return flag.lstrip("-").replace("-", "_")


def choose(args: argparse.Namespace, flag: str, *, matmuls: bool = True, capability: Optional[str] = None,
           fixed: Optional[DtypeChoice] = None) -> DtypeChoice:
    """A section's dtype: its own ``flag`` (``"--ce-dtype"``) where the user set it, else
    ``--dtype``, else ``fixed`` (a section that runs one dtype on every host), else
    :func:`default_dtype` for ``args.device``. An unknown dtype name raises ``ValueError``."""
    for given_flag in (flag, "--dtype"):
        given = getattr(args, flag_attribute(given_flag), None)
        if given is not None:
            if given not in DTYPE_NAMES:
                raise ValueError(f"{given_flag} must be one of {', '.join(DTYPE_NAMES)}, got {given!r}")
            return DtypeChoice(given, f"chosen with {given_flag}")
    if fixed is not None:
        return fixed
    choice = default_dtype(getattr(args, "device", "cpu"), capability, matmuls=matmuls)
    if choice.dtype != "bf16":
        choice = DtypeChoice(choice.dtype, f"{choice.reason}; {flag} bf16 (or --dtype bf16) to force")
    return choice
