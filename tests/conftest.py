"""Shared test configuration: hypothesis profiles and a reused torch.compile cache.

Profiles: ``dev`` (default, fast), ``ci`` (derandomised, no deadline, no example database;
chosen when ``CI=true``), ``nightly`` (many examples; ``HYPOTHESIS_PROFILE=nightly``).
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import HealthCheck, settings

# Compiled graphs are cached across test runs on the same machine (first compile: 10-20 s).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "lean-llm-train-inductor")
)

_slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=_slow_ok)
settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=_slow_ok,
)
settings.register_profile(
    "nightly", max_examples=400, deadline=None, suppress_health_check=_slow_ok
)

_default = "ci" if os.environ.get("CI", "").lower() == "true" else "dev"
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", _default))

# Under pytest-xdist (`-n 2`, as CI runs), each worker gets its share of the cores: two workers
# with torch's default thread count each would oversubscribe a 2-core machine.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))
