"""LlamaIndex integration: `BlendLLM`, `BlendNodePostprocessor` and `BlendSynthesizer`.

Query engines get blended prefill: the node postprocessor precomputes the KV of exactly the
text each node puts into the prompt, the synthesizer keeps those texts intact, and the LLM finds
them in the final prompt and reuses their KV wherever they land. `blend_query_engine` wires the
three. Needs the ``llamaindex`` extra: ``pip install -e ".[llamaindex]"`` in a clone of kvblend,
or the built wheel with it (``pip install "dist/kvblend-0.1.0-py3-none-any.whl[llamaindex]"``).
"""

try:
    import llama_index.core  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "kvblend.llamaindex needs llama-index-core: pip install 'llama-index-core>=0.14' (the "
        "llamaindex extra; from a clone of kvblend: pip install -e '.[llamaindex]')"
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
