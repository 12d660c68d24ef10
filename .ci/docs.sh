#!/usr/bin/env bash
# Build the documentation site strictly: any warning (a broken link, a docstring griffe cannot
# parse, a name of an __all__ missing from the API pages) fails the build.
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1
python -m mkdocs build --strict --site-dir "${SITE_DIR:-site}"
