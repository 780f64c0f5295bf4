"""kvblend inside vLLM: an out-of-tree KV connector that blends stored documents into prompts.

Use it with ``kv_transfer_config={"kv_connector": "KVBlendConnector", "kv_connector_module_path":
"kvblend.vllm", "kv_role": "kv_both"}`` (``vllm serve MODEL --kv-transfer-config '{...}'``);
the ``vllm.general_plugins`` entry point `kvblend.vllm.plugin.register` hands the loaded model to
the connector. ``KVBlendConnector`` is imported on first use, so the package's vLLM-free parts
(`kvblend.vllm.request_plan`, `kvblend.vllm.settings`) import without vLLM installed. The
scheduler side is in `scheduling/`, the worker side in `execution/`; what vLLM and both sides
meet (the connector, the plugin, `compat`, the settings, the messages of `requests`) is here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVBlendConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVBlendConnector":
        from kvblend.vllm.connector import KVBlendConnector

        return KVBlendConnector
    raise AttributeError(f"module 'kvblend.vllm' has no attribute {name!r}")
