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
- ``log_requests`` (true): one INFO line per request the connector plans;
- ``when`` (``"faster"``): blend a request only when its blend is forecast to reach the first
  token sooner than vLLM's own prefill (`costs.CostModel`); ``"always"``: whenever the
  strategy's rules allow;
- ``slice_s`` (1.0): the longest a blend holds up an engine step, in seconds (`pacing`);
- ``kv_codec`` (``"none"``): how the documents' KV is stored and read (`kvblend.blend.kv_codec`:
  ``none``, full precision, or ``int8``, ``k8v4``, ``int4``); entries of another codec are not
  read (they have other keys), a document the store holds only in another codec is computed
  and stored in this one.

A request chooses for itself through vLLM's ``kv_transfer_params``, in one form:
``{"kvblend": false}`` (vLLM's own prefill), or ``{"kvblend": {"strategy": ..., "settings":
{...}, "when": ...}}`` with the keys of ``kv_connector_extra_config`` of the same names, each
optional. Anything else is refused: the OpenAI server answers 400 with the reason
(`options.KVBlendOptions` checks each request as it arrives), and a request that reaches the
scheduler all the same (another frontend) is prefilled by vLLM with the reason in its record.
Through the OpenAI server: ``extra_body={"kv_transfer_params": {"kvblend": {...}}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvblend.blend.config import BlendConfig
from kvblend.blend.kv_codec import kv_codec
from kvblend.prompt.templates import DEFAULT_SYSTEM_PROMPT

__all__ = ["ConnectorSettings", "RequestChoice", "check_options", "request_config"]

_KEYS = frozenset(
    {
        "strategy",
        "settings",
        "system_prompt",
        "store_dir",
        "redis_url",
        "parity",
        "log_requests",
        "when",
        "slice_s",
        "kv_codec",
    }
)
#: What ``when`` takes: blend only when forecast faster than vLLM's prefill, or always.
WHEN = ("faster", "always")
#: The keys a request's ``kv_transfer_params["kvblend"]`` dict takes.
REQUEST_KEYS = ("strategy", "settings", "when")


@dataclass(frozen=True)
class ConnectorSettings:
    """What ``kv_connector_extra_config`` sets (see the module's docstring)."""

    config: BlendConfig = field(default_factory=BlendConfig)
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    store_dir: str | None = None
    redis_url: str | None = None
    parity: bool = True
    log_requests: bool = True
    when: str = "faster"
    slice_s: float = 1.0
    kv_codec: str = "none"

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
            when=_when(extra.get("when", "faster"), "kv_connector_extra_config"),
            slice_s=_slice(extra.get("slice_s", 1.0)),
            kv_codec=_codec(extra.get("kv_codec")),
        )


def _when(value: Any, where: str) -> str:
    if value not in WHEN:
        raise ValueError(
            f"{where}: 'when' must be one of {', '.join(map(repr, WHEN))}, got {value!r}"
        )
    return str(value)


def _codec(value: Any) -> str:
    try:
        return kv_codec(value).name
    except (ValueError, TypeError) as error:
        raise ValueError(f"kv_connector_extra_config: 'kv_codec': {error}") from None


def _slice(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 60:
        raise ValueError(
            f"kv_connector_extra_config: 'slice_s' must be seconds in (0, 60], got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class RequestChoice:
    """What one request asks for: its `BlendConfig` (None: vLLM's own prefill) and ``when``."""

    config: BlendConfig | None
    when: str


def request_config(
    default: BlendConfig, params: dict[str, Any] | None, when: str = "faster"
) -> RequestChoice:
    """Return one request's choice: its ``kv_transfer_params["kvblend"]``, else the defaults.

    The one accepted form: absent (the server's settings), ``false`` (vLLM's own prefill), or a
    dict of ``strategy``, ``settings`` (a dict) and ``when``, each optional; a strategy given
    without settings takes that strategy's defaults, settings without a strategy apply to the
    server's. Anything else raises ValueError naming what is wrong (the request is refused).
    """
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    chosen = (params or {}).get("kvblend")
    if chosen is None:
        return RequestChoice(default, when)
    if chosen is False:
        return RequestChoice(None, when)
    if not isinstance(chosen, dict):
        raise ValueError(
            "kv_transfer_params['kvblend'] must be false or a dict of "
            f"{', '.join(REQUEST_KEYS)}, got {chosen!r}"
        )
    unknown = sorted(set(chosen) - set(REQUEST_KEYS))
    if unknown:
        raise ValueError(
            f"kv_transfer_params['kvblend'] has no key {', '.join(map(repr, unknown))}: it takes "
            f"{', '.join(REQUEST_KEYS)} (a strategy's settings go under 'settings', e.g. "
            '{"strategy": "attention", "settings": {"recompute_ratio": 0.3}})'
        )
    settings = chosen.get("settings", {})
    if not isinstance(settings, dict):
        raise ValueError(
            f"kv_transfer_params['kvblend']['settings'] must be a dict, got {settings!r}"
        )
    if "strategy" in chosen:
        strategy = chosen["strategy"]
        if not isinstance(strategy, str):
            raise ValueError(
                f"kv_transfer_params['kvblend']['strategy'] must be a string, got {strategy!r}"
            )
        config = BlendConfig(strategy, **settings)
    else:
        config = default.replace(**settings) if settings else default
    return RequestChoice(config, _when(chosen.get("when", when), "kv_transfer_params['kvblend']"))


def check_options(kv_transfer_params: Any) -> None:
    """Raise ValueError when ``kv_transfer_params`` holds kvblend options in another form.

    What vLLM's frontend runs on each request as it arrives (`kvblend.vllm.options`); a request
    without kvblend options passes.
    """
    if isinstance(kv_transfer_params, dict) and "kvblend" in kv_transfer_params:
        request_config(BlendConfig(), kv_transfer_params)
