"""Public names of the adapters' shared layer, for code that writes its own framework glue.

The LangChain and LlamaIndex adapters share one framework-neutral layer, the private module
`kvblend._adapters`: one engine per model spec and process (`shared_engine`, `adopt_engine`), a
finished prompt cut into segments over the known documents (`prompt_segments`), one prompt's
blended prefill and decoding (`run_prompt`, `stream_prompt`, `BlendRun`), several prompts
decoded in one batch (`run_prompts`; `gather_prompt` for concurrent async calls), precomputing
texts (`precompute_texts`, `SEGMENT_ID_KEY`) and the async glue (`iterate_in_thread`). Its
public names are importable from here, their documented place; the rest of it changes with the
adapters.
Like the layer itself, this module imports no framework.
"""

from ._adapters import (
    SEGMENT_ID_KEY,
    BlendRun,
    adopt_engine,
    gather_prompt,
    iterate_in_thread,
    model_name,
    precompute_texts,
    prompt_segments,
    run_prompt,
    run_prompts,
    shared_engine,
    stream_prompt,
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
