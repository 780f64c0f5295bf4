"""`BlendLLMSettings`: what the LlamaIndex `BlendLLM` is configured with, and its engine.

The fields (the engine or model to load, the blend config, decoding options under LlamaIndex's
and transformers' names, the prompt handling), their checks (unknown constructor arguments get
one `TypeError` naming the closest field), the engine loaded lazily and shared per model spec
(`kvblend.integrations.shared`), and one call's decoding options merged over the fields and
``generate_kwargs``. `kvblend.llamaindex.llms.BlendLLM` adds LlamaIndex's calls on top, as
`kvblend.langchain._shared.BlendSettings` does for the LangChain models.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate

from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.integrations.conventions import (
    FRAMEWORK_EXTRAS,
    GENERATION_OPTIONS,
    EngineHolder,
    check_arguments,
    check_passthrough,
    check_window_fits,
    decode_options,
)
from kvblend.integrations.shared import adopt_engine, lazy_engine, model_name

# Per-call keyword arguments accepted by complete()/chat() and their streaming variants.
_CALL_OPTIONS = (*GENERATION_OPTIONS, "stop")

# HuggingFaceLLM constructor arguments that load a model: they belong to `from_model_id`.
_LOADING_ARGUMENTS = ("model_name", "model_kwargs", "device_map", "tokenizer_name")


class BlendLLMSettings(EngineHolder, BaseModel):
    """Fields and helpers of the kvblend LlamaIndex LLM (`BlendLLM`).

    Unknown constructor arguments raise one `TypeError` naming the closest field; ``api_key``,
    ``timeout`` and ``max_retries`` are accepted and have no effect. Pickling keeps the
    engine's model spec and reloads (or shares) that engine lazily; a deep copy shares the live
    engine.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: BlendEngine | None = Field(
        default=None,
        exclude=True,
        description="A ready BlendEngine (share it with BlendNodePostprocessor). When None, one "
        "is built on first use from `model` and shared per model spec.",
    )
    model: str | None = Field(
        default=None,
        description="Model to load when no `engine` is given: a folder, GGUF file or hub id. "
        "None means KVBLEND_MODEL or the bundled SmolLM2-135M-Instruct.",
    )
    blend_config: BlendConfig | None = Field(
        default=None,
        description="How the blended prefill recomputes reused tokens (None = BlendConfig()).",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="torch CPU threads, for the whole process, from the first call on (None: "
        "the engine's load-aware default, the cores the last minute's load leaves idle).",
    )
    max_tokens: int = Field(default=256, ge=1, description="Largest number of tokens to generate.")
    max_new_tokens: int | None = Field(
        default=None,
        ge=1,
        description="transformers' name for max_tokens (when set, this one is used).",
    )
    temperature: float = Field(
        default=0.0,
        ge=0.0,
        description="Sampling temperature; 0 decodes greedily (unless do_sample=True).",
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (when sampling)."
    )
    top_k: int = Field(
        default=0, ge=0, description="Sample among the top_k most likely tokens (0: no limit)."
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, description="transformers' repetition penalty (1: none)."
    )
    do_sample: bool | None = Field(
        default=None,
        description="Sample (True) or decode greedily (False); None samples when "
        "temperature > 0. True at temperature 0 samples at temperature 1, as transformers does.",
    )
    seed: int | None = Field(default=None, description="Random seed for sampling.")
    generate_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More generation options by name, as HuggingFaceLLM's generate_kwargs: "
        "max_tokens, max_new_tokens, temperature, top_p, top_k, repetition_penalty, do_sample, "
        "seed (other keys are refused). A call's keyword arguments win over them.",
    )
    context_window: int | None = Field(
        default=None,
        ge=1,
        description="Tokens of prompt plus max_tokens a call may use, reported as "
        "metadata.context_window (None: the model's own window).",
    )
    query_wrapper_prompt: BasePromptTemplate | None = Field(
        default=None,
        exclude=True,
        description="Template with {query_str} that complete() wraps an unformatted prompt in "
        "(a str or a PromptTemplate), as HuggingFaceLLM does.",
    )
    stop: list[str] | None = Field(
        default=None, description="Stop sequences: the output is cut before the first one."
    )
    separator: str | None = Field(
        default=None,
        description="Explicit separator mode: split the prompt on this string (removed) and "
        "treat each piece between two separators as a cached document.",
    )
    cache_prefix: bool = Field(
        default=False,
        description="Also cache the text before the first document as a prefix reused at its "
        "own position.",
    )
    chat_template: bool = Field(
        default=True,
        description="Use the model's chat template: chat messages are rendered with it and a "
        "complete() prompt (unless formatted=True) is sent as one user message. Reported as "
        "metadata.is_chat_model, so query engines send chat messages.",
    )

    _engine: BlendEngine | None = PrivateAttr(default=None)

    @field_validator("engine")
    @classmethod
    def _share_engine(cls, engine: BlendEngine | None) -> BlendEngine | None:
        return adopt_engine(engine)

    @field_validator("query_wrapper_prompt", mode="before")
    @classmethod
    def _wrapper_template(cls, value: Any) -> Any:
        return PromptTemplate(value) if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, data: Any) -> Any:
        """Refuse unknown constructor arguments; drop the framework-wide no-op ones."""
        if not isinstance(data, dict):
            return data
        for name in _LOADING_ARGUMENTS:
            if name in data:
                raise TypeError(
                    f"BlendLLM got {name}=: a model is loaded by BlendLLM.from_model_id("
                    "model_name, device_map=..., model_kwargs=...), or give engine= / model="
                )
        known = set(cls.model_fields) | set(FRAMEWORK_EXTRAS)
        check_arguments(cls.__name__, data, known, "argument")
        check_passthrough(cls.__name__, "generate_kwargs", data.get("generate_kwargs"))
        return {key: value for key, value in data.items() if key not in FRAMEWORK_EXTRAS}

    def get_engine(self) -> BlendEngine:
        """Return the engine, loading the shared one for ``model`` on first use."""
        engine = lazy_engine(self)
        check_window_fits(type(self).__name__, self.context_window, engine)
        return engine

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer as LlamaIndex wants one: ``text -> token ids`` (loads the model).

        Set ``Settings.tokenizer = llm.tokenizer`` (or pass it to ``TokenCountingHandler`` and
        ``PromptHelper``) so that LlamaIndex counts and packs with the model's real tokens.
        """
        return self.get_engine().tokenize

    @property
    def model_name(self) -> str:
        """Name of the model, without loading it."""
        return model_name(self.engine or self._engine, self.model)

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Merge the fields, ``generate_kwargs`` and one call's keywords into decoding options."""
        check_arguments(type(self).__name__, kwargs, _CALL_OPTIONS, "keyword argument")
        fields = {name: getattr(self, name) for name in GENERATION_OPTIONS}
        if self.max_new_tokens is not None:
            fields.pop("max_tokens")  # the HF name, when set, wins over the default
        call = {name: kwargs[name] for name in GENERATION_OPTIONS if name in kwargs}
        options = decode_options(
            [
                (fields, "fields"),
                (self.generate_kwargs, "in generate_kwargs"),
                (call, "in one call"),
            ]
        )
        options["stop"] = kwargs.get("stop", self.stop) or None
        return options
