"""The TTFT benchmark's ``transformers`` row: plain transformers as a user calls it today.

The baseline a user compares kvblend with is not kvblend's own full prefill but the code they
run without it: ``AutoModelForCausalLM.from_pretrained`` on the same checkpoint folder, in the
dtype the engine computes in (its ``dtype="auto"`` choice unless asked otherwise), the
tokenizer's chat template over the same messages, and ``generate(max_new_tokens=1)``. A run is
timed from the messages (the template rendered and tokenized) to the first token, in the
benchmark's process, so on the same threads as the engine; `kvblend.bench.speed.ttft.run_ttft`
interleaves it with the strategies in every repeat.

The messages are those the engine's RAG prompt renders (`rag_messages`: the system prompt, then
one user message of the documents and the question, as `BlendEngine.rag_segments` lays them
out), so both sides read the same text: each row records its prompt's token count and the first
token it produced, which the engine's ``full`` equals.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvblend.bench.speed.peak_memory import PeakMemory
from kvblend.bench.speed.ttft_summary import BASELINE
from kvblend.engine.engine import BlendEngine
from kvblend.models.loading import model_folder

__all__ = ["STRATEGY", "TransformersBaseline", "baseline_source", "rag_messages"]

#: The baseline's name in the benchmark's rows and summary.
STRATEGY = BASELINE


def rag_messages(
    system: str | None, documents: Sequence[str], question: str, separator: str = "\n\n"
) -> list[dict[str, str]]:
    """Chat messages whose template renders the text of `BlendEngine.rag_segments`' prompt."""
    user = "Documents:" + separator + separator.join(documents)
    user += f"{separator}Question: {question}"
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": user}]


def baseline_source(engine: BlendEngine) -> str:
    """Return the checkpoint transformers loads for ``engine``'s model (GGUF: its folder).

    A GGUF file gives `kvblend.models.loading.model_folder`'s Hugging Face folder (what
    ``kvblend model-folder`` prints); a folder or hub id is loaded as it is.
    """
    if engine.model_spec is None:
        raise ValueError("the transformers baseline needs an engine from from_pretrained")
    if engine.model_spec.endswith(".gguf"):
        return str(model_folder(engine.model_spec))
    return engine.model_spec


class TransformersBaseline:
    """A plain transformers model and tokenizer over ``engine``'s checkpoint, timed to a token."""

    def __init__(self, engine: BlendEngine) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.source = baseline_source(engine)
        self.device = engine.decoder.device
        self.dtype = engine.decoder.dtype
        self.tokenizer: Any = AutoTokenizer.from_pretrained(self.source)
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            self.source, dtype=self.dtype, device_map=self.device
        ).eval()

    def describe(self) -> dict[str, Any]:
        """Describe the baseline for the result's record."""
        return {
            "source": self.source,
            "dtype": str(self.dtype).removeprefix("torch."),
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "call": "apply_chat_template(messages, add_generation_prompt=True) + "
            "generate(max_new_tokens=1)",
        }

    def time(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """One run from ``messages`` to the first token: its TTFT and what it read and made."""
        with PeakMemory(self.device) as peak:
            started = time.perf_counter()
            inputs = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
            ).to(self.device)
            encoded = time.perf_counter()
            output = self.model.generate(**inputs, max_new_tokens=1, do_sample=False)
            first = int(output[0, -1])  # on the host: the device has finished
            ttft = time.perf_counter() - started
        prompt_tokens = int(inputs["input_ids"].shape[1])
        return {
            "ttft_s": ttft,
            "prompt_s": encoded - started,
            "prefill_s": ttft,
            "lookup_s": None,
            "load_s": None,
            "blend_s": None,
            "blend_device_s": None,
            "load_device_s": None,
            "uncompiled_calls": 0,
            "prompt_tokens": prompt_tokens,
            "recompute_fraction": 0.0,
            "compute_fraction": 1.0,
            "segments_precomputed": 0,
            "peak_mib": peak.mib,
            "first_token": first,
        }

    def close(self) -> None:
        """Free the baseline's model."""
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
