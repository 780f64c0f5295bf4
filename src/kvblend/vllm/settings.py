"""The connector's settings: ``kv_connector_extra_config``, and a request's own choice.

``--kv-transfer-config '{"kv_connector": "KVBlendConnector", "kv_connector_module_path":
"kvblend.vllm", "kv_role": "kv_both", "kv_connector_extra_config": {...}}'`` takes these keys,
all optional:

- ``strategy`` (``"attention"``) and ``settings`` (a dict): the `BlendConfig` of every request;
- ``system_prompt``: the system prompt of the chat RAG head documents are precomputed behind
  when the connector stores one itself (default: the engine's ``DEFAULT_SYSTEM_PROMPT``; the
  registry finds documents whatever head they were stored behind);
- ``store_dir`` / ``redis_url``: the store (default ``$KVBLEND_STORE_DIR`` and
  ``$KVBLEND_REDIS_URL``, as every kvblend process);
- ``parity`` (true): run the parity gate when the worker starts (false: blend without it);
- ``log_requests`` (true): one INFO line per blended request.

A request chooses for itself through vLLM's ``kv_transfer_params``: ``{"kvblend": {"strategy":
"full"}}`` (any `BlendConfig` strategy and settings) or ``{"kvblend": false}`` (vLLM's own
prefill). Through the OpenAI server: ``extra_body={"kv_transfer_params": {...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import DEFAULT_SYSTEM_PROMPT

__all__ = ["ConnectorSettings", "request_config"]

_KEYS = frozenset(
    {"strategy", "settings", "system_prompt", "store_dir", "redis_url", "parity", "log_requests"}
)


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` sets (see the module's docstring)."""

    config: BlendConfig = field(default_factory=BlendConfig)
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    store_dir: str | None = None
    redis_url: str | None = None
    parity: bool = True
    log_requests: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Read and check ``kv_connector_extra_config`` (a wrong key or setting: ValueError)."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ValueError(
                f"kvblend's connector has no setting {', '.join(map(repr, unknown))} "
                f"(kv_connector_extra_config takes: {', '.join(sorted(_KEYS))})"
            )
        config = BlendConfig(
            str(extra.get("strategy", "attention")), **dict(extra.get("settings") or {})
        )
        return cls(
            config=config,
            system_prompt=extra.get("system_prompt", DEFAULT_SYSTEM_PROMPT) or None,
            store_dir=extra.get("store_dir"),
            redis_url=extra.get("redis_url"),
            parity=bool(extra.get("parity", True)),
            log_requests=bool(extra.get("log_requests", True)),
        )


def request_config(default: BlendConfig, params: dict[str, Any] | None) -> BlendConfig | None:
    """Return one request's config: its ``kv_transfer_params["kvblend"]``, else ``default``.

    None when the request turns kvblend off (``{"kvblend": false}``). A wrong strategy or
    setting raises ValueError, which the scheduler reports as the request's fallback.
    """
    chosen = (params or {}).get("kvblend")
    if chosen is None or chosen is True:
        return default
    if chosen is False:
        return None
    if not isinstance(chosen, dict):
        raise ValueError(f"kv_transfer_params['kvblend'] must be a dict or a bool, got {chosen!r}")
    chosen = dict(chosen)
    strategy = str(chosen.pop("strategy", default.strategy))
    return BlendConfig(strategy, **chosen)
