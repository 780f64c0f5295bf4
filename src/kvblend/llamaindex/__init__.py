"""LlamaIndex integration: `BlendLLM`, `BlendNodePostprocessor` and `BlendSynthesizer`.

Query engines get blended prefill: the node postprocessor precomputes the KV of exactly the
text each node puts into the prompt, the synthesizer keeps those texts intact, and the LLM finds
them in the final prompt and reuses their KV wherever they land. `blend_query_engine` wires the
three. Needs the ``llamaindex`` extra: ``pip install "kvblend[llamaindex]"``.
"""

try:
    import llama_index.core  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "kvblend.llamaindex needs llama-index-core; install it with: "
        'pip install "kvblend[llamaindex]"'
    ) from error

from kvblend.integrations.shared import SEGMENT_ID_KEY
from kvblend.llamaindex.llms import BlendLLM
from kvblend.llamaindex.postprocessor import BlendNodePostprocessor
from kvblend.llamaindex.synthesizer import BlendSynthesizer, blend_query_engine

__all__ = [
    "SEGMENT_ID_KEY",
    "BlendLLM",
    "BlendNodePostprocessor",
    "BlendSynthesizer",
    "blend_query_engine",
]
