"""Why vLLM prefills a request itself: `RequestFallback`, a reason's code beside its words.

Each place the connector leaves a request to vLLM's own prefill (vLLM's needs, the request's
options, the parity gate, the plan, the store, the strategy's rules, the admission policy)
decides a `RequestFallback`. Its ``code`` is what the metrics count requests by (label
``reason``), the record's ``reason`` and the log's once-a-minute key; its words, rendered once
(`describe_request_fallback`), are the record's ``fallback`` and the log line. Nothing reads a
code back out of the words.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NO_DOCUMENT", "VLLM_FASTER", "RequestFallback", "describe_request_fallback"]


@dataclass(frozen=True)
class RequestFallback:
    """Why vLLM prefills one request itself.

    ``code``: a short label (``"vllm_faster"``, ``"not_stored"``, ``"full_above"``...);
    ``words``: why, as a person reads it. ``str()`` is the line (`describe_request_fallback`).
    """

    code: str
    words: str

    def __str__(self) -> str:
        return describe_request_fallback(self)


def describe_request_fallback(fallback: RequestFallback) -> str:
    """Return what a request's record (``fallback``) and the log say of ``fallback``."""
    return fallback.words


#: The fallback of a prompt in which the registry finds no document (the scheduler side says
#: why, from what the store holds: `kvblend.vllm.documents.StoreSummary`).
NO_DOCUMENT = RequestFallback("no_stored_document", "no stored document in the prompt")

#: The code of a request left to vLLM because its own prefill is forecast faster than a blend
#: (`kvblend.vllm.admission`): the one the log says per request, not once a minute.
VLLM_FASTER = "vllm_faster"
