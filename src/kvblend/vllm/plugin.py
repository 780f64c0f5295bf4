"""The vLLM general plugin that hands the loaded model to kvblend's connector.

vLLM's KV connector API never gives a connector the model (its worker side sees the paged KV
cache and the attention layers only), and the connector is built after the model is loaded.
This plugin, registered under the ``vllm.general_plugins`` entry point, runs in every vLLM
process before any model is loaded and wraps the model loaders' ``load_model`` (vLLM's
``BaseModelLoader``, which every weight format's loader inherits) so that the target model each
worker loads is recorded here; the connector's worker side takes it from `loaded_model`. No vLLM
file is changed: the wrapper calls the original method and only keeps a reference to its result.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["loaded_model", "register"]

_LOCK = threading.Lock()
_MODEL: Any = None
_PATCHED = False


def loaded_model() -> Any:
    """Return the target model this process's vLLM worker loaded (None: none yet)."""
    return _MODEL


def _remember(model: Any, vllm_config: Any, model_config: Any) -> None:
    """Keep ``model`` when it is the engine's target model (not a draft or an encoder)."""
    global _MODEL
    if model_config is getattr(vllm_config, "model_config", model_config):
        with _LOCK:
            _MODEL = model


def register() -> None:
    """Wrap vLLM's ``BaseModelLoader.load_model`` once per process (the plugin's entry point).

    vLLM may call a plugin several times in one process; the wrapper is installed once. A vLLM
    without that loader leaves the connector without a model, and it then refuses to blend with
    one log line.
    """
    global _PATCHED
    with _LOCK:
        if _PATCHED:
            return
        _PATCHED = True
    try:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError as error:  # another vLLM layout: the connector says so when it starts
        logger.warning("kvblend cannot hand the model to its connector: %s", error)
        return
    original = BaseModelLoader.load_model

    @functools.wraps(original)
    def load_model(
        self: Any, vllm_config: Any, model_config: Any, *args: Any, **kwargs: Any
    ) -> Any:
        model = original(self, vllm_config, model_config, *args, **kwargs)
        _remember(model, vllm_config, model_config)
        return model

    BaseModelLoader.load_model = load_model
