"""The vLLM general plugin that hands the loaded model to kvblend's connector.

vLLM's KV connector API never gives a connector the model (its worker side sees the paged KV
cache and the attention layers only), and the connector is built after the model is loaded.
This plugin, registered under the ``vllm.general_plugins`` entry point, runs in every vLLM
process before any model is loaded and has vLLM's model loaders report the target model each
worker loads (`compat.on_model_loaded`); the connector's worker side takes it from
`loaded_model`. No vLLM file is changed.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kvblend.vllm.compat import on_model_loaded

logger = logging.getLogger(__name__)

__all__ = ["loaded_model", "register"]

_LOCK = threading.Lock()
_MODEL: Any = None
_REGISTERED = False


def loaded_model() -> Any:
    """Return the target model this process's vLLM worker loaded (None: none yet)."""
    return _MODEL


def _remember(model: Any, vllm_config: Any, model_config: Any) -> None:
    """Keep ``model`` when it is the engine's target model (not a draft or an encoder)."""
    global _MODEL
    if model_config is vllm_config.model_config:
        with _LOCK:
            _MODEL = model


def register() -> None:
    """Have vLLM's loaders report the models they load, once per process (the entry point).

    vLLM may call a plugin several times in one process; the hook is installed once. A vLLM
    without that loader leaves the connector without a model, and it then refuses to blend with
    one log line.
    """
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        _REGISTERED = True
    why = on_model_loaded(_remember)
    if why is not None:  # another vLLM layout: the connector says so when it starts
        logger.warning("kvblend cannot hand the model to its connector: %s", why)
