"""Refusing a request's malformed kvblend options where it arrives, before it is queued.

vLLM runs the ``validate_params`` hook of every logits processor registered under its
``vllm.logits_processors`` entry point on each request as the frontend admits it; an error there
is the client's: the OpenAI server answers 400 with the message, ``LLM.generate`` raises. kvblend
registers `KVBlendOptions` there only for that hook: it checks ``kv_transfer_params["kvblend"]``
(`settings.request_config`) and changes no logits (it is argmax-invariant and does nothing per
step). A request without kvblend options, or a server without the connector, is untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from kvblend.vllm.settings import check_options

__all__ = ["KVBlendOptions"]


class KVBlendOptions(LogitsProcessor):
    """Validates kvblend's per-request options at admission; changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Refuse a request whose ``kv_transfer_params["kvblend"]`` has another form."""
        extra = sampling_params.extra_args or {}
        try:
            check_options(extra.get("kv_transfer_params"))
        except (TypeError, ValueError) as error:
            raise ValueError(f"kvblend refused this request's options: {error}") from None

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """Nothing to hold: the hook above is the point."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Return ``logits`` unchanged."""
        return logits

    def is_argmax_invariant(self) -> bool:
        """Return True: it never changes the argmax."""
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Nothing per request."""
