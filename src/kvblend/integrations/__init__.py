"""Public names of the adapters' shared layer, for code that writes its own framework glue.

The LangChain and LlamaIndex adapters share one framework-neutral layer, this package: one
engine per model spec and process (`shared_engine`, `adopt_engine`), a finished prompt cut into
segments over the known documents (`prompt_segments`), one prompt's blended prefill and decoding
(`run_prompt`, `stream_prompt`, `BlendRun`), several prompts decoded in one batch
(`run_prompts`; `gather_prompt` for concurrent async calls), precomputing texts
(`precompute_texts`, `SEGMENT_ID_KEY`) and the async glue (`iterate_in_thread`). Its public
names are importable from here, their documented place; the rest of it (`shared`, `runs`,
`background`, `conventions`) changes with the adapters. Nothing here imports a framework.
"""

from kvblend.integrations.background import gather_prompt, iterate_in_thread
from kvblend.integrations.runs import BlendRun, run_prompt, run_prompts, stream_prompt
from kvblend.integrations.shared import (
    SEGMENT_ID_KEY,
    adopt_engine,
    model_name,
    precompute_texts,
    prompt_segments,
    shared_engine,
)

__all__ = [
    "SEGMENT_ID_KEY",
    "adopt_engine",
    "BlendRun",
    "gather_prompt",
    "iterate_in_thread",
    "model_name",
    "precompute_texts",
    "prompt_segments",
    "run_prompt",
    "run_prompts",
    "shared_engine",
    "stream_prompt",
]
