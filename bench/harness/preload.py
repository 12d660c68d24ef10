"""What the measuring processes' server (:mod:`bench.harness.isolated`) does once, so that no measurement
pays for it: import torch, Transformers with its ``Trainer``, TRL, the three packages and
inductor's compiler, and probe the CPU's vector instructions for inductor (six child processes,
about a second, which inductor otherwise repeats in every process that compiles; the answer is
cached for the process and inherited by every child forked from it).

Importing this module starts no thread and allocates no tensor: a process forked from it is as
fresh as one started from scratch, with these modules in place. A module that is not installed
is skipped.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

#: Imported in this order; TRL and Transformers are optional.
MODULES = ("torch", "torch._inductor.compile_fx", "transformers", "transformers.trainer", "trl", "functional_ce",
           "model_patches", "ac_policies")

for _name in MODULES:
    try:
        importlib.import_module(_name)
    except ImportError as exc:
        logger.debug("preload: %s not imported (%s)", _name, exc)

try:
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()  # functools.cache: the probe runs here, once
except Exception as exc:  # noqa: BLE001 - a private API: without it each process probes on its own
    logger.debug("preload: inductor's vector-ISA probe not cached (%s)", exc)
