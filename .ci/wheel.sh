#!/usr/bin/env bash
# Build the wheel, install it with torch into a fresh virtualenv, and check it from outside the
# checkout: the three packages import and run, and bench/ and tests/ are not installed.
# PYTHON picks the interpreter that builds and makes the venv (default python3); PIP_FIND_LINKS,
# when set, lets pip take torch from a local folder of wheels. DEPS_FROM=SITE_PACKAGES (CI) installs
# the wheel alone and reads its dependencies (torch, transformers) from that folder, appended to the
# fresh venv's path by a .pth line (whose own .pth files, such as an editable install's, are not
# run): the same check without a second torch install (about three minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
start=$SECONDS

isolation=--no-build-isolation  # the building Python has setuptools >= 77: nothing to download
"$PYTHON" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" 2>/dev/null || isolation=
"$PYTHON" -m pip wheel -q --no-deps $isolation -w "$work/dist" .
wheel="$(ls "$work"/dist/lean_llm_train-*.whl)"
echo "built $(basename "$wheel") in $((SECONDS - start)) s"
"$PYTHON" - "$wheel" <<'PY'
import sys
import zipfile

tops = {name.split("/")[0] for name in zipfile.ZipFile(sys.argv[1]).namelist()}
packages = {t for t in tops if not t.endswith((".dist-info", ".data"))}
assert packages == {"functional_ce", "model_patches", "ac_policies", "patch_layer"}, packages
PY

"$PYTHON" -m venv "$work/venv"
t=$SECONDS
if [ -n "${DEPS_FROM:-}" ]; then
  "$work/venv/bin/python" -m pip install -q --no-deps "$wheel"
  site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$DEPS_FROM" > "$site/zz_dependencies.pth"
  echo "installed the wheel in $((SECONDS - t)) s; dependencies from $DEPS_FROM"
else
  "$work/venv/bin/python" -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  echo "installed torch in $((SECONDS - t)) s"
  t=$SECONDS
  "$work/venv/bin/python" -m pip install -q "$wheel"
  echo "installed the wheel and its dependencies in $((SECONDS - t)) s"
fi

cd "$work"  # outside the checkout: only the installed packages can be imported
"$work/venv/bin/python" - <<'PY'
import importlib.util

import torch
import transformers

import ac_policies
import functional_ce
import model_patches
import patch_layer

for name in ("bench", "tests"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed as a top-level package"
for package in (functional_ce, model_patches, ac_policies, patch_layer):
    assert "site-packages" in package.__file__, package.__file__
    missing = [n for n in package.__all__ if not hasattr(package, n) and n != "ChunkOptions"]
    assert not missing, (package.__name__, missing)

hidden = torch.randn(8, 16, requires_grad=True)
weight = torch.randn(32, 16, requires_grad=True)
labels = torch.randint(0, 32, (8,))
loss = functional_ce.linear_cross_entropy(hidden, weight, labels)
loss.backward()
reference = torch.nn.functional.cross_entropy(hidden.detach() @ weight.detach().T, labels)
torch.testing.assert_close(loss.detach(), reference)

config = transformers.AutoConfig.for_model(
    "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64,
)
model = transformers.AutoModelForCausalLM.from_config(config)
rows = ac_policies.plan(model, "full")
assert any(row.action == "checkpoint" for row in rows), rows
print(f"wheel ok: loss {loss.item():.4f}, {len(rows)} plan rows")
PY
echo "wheel check passed in $((SECONDS - start)) s"
