"""The frameworks' conventions the adapters share: options, argument checks, copies, loading.

Framework-neutral (pydantic and the engine only), like `kvblend.integrations.shared`:

- `GENERATION_OPTIONS` and `decode_options`: the decoding options every adapter takes as a field,
  in its ``model_kwargs`` / ``generate_kwargs`` and as a call keyword, with transformers' names
  (``max_new_tokens`` is the HF name of ``max_tokens``), merged into `BlendEngine.generate`
  keywords;
- `check_arguments` / `check_passthrough`: one clear error for an unknown constructor or call
  argument, naming the closest known one;
- `check_context_window`: prompt plus output budget against an adapter's ``context_window``;
- `EngineHolder`: pickling and deep copies of an adapter that never touch the live object;
- `load_engine`: the engine of a ``from_model_id`` constructor.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import pydantic

from kvblend.engine.engine import BlendEngine
from kvblend.integrations.shared import adopt_engine

#: Decoding options accepted as fields, in ``model_kwargs`` / ``generate_kwargs`` and per call.
GENERATION_OPTIONS = (
    "max_tokens",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "do_sample",
    "seed",
)

#: Constructor arguments that frameworks and their test suites pass to every model: accepted
#: and without effect (a local model has no API key, network timeout or retries).
FRAMEWORK_EXTRAS = ("api_key", "timeout", "max_retries")


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_arguments(owner: str, given: Iterable[str], known: Iterable[str], what: str) -> None:
    """Raise one `TypeError` naming the first unknown argument (and the closest known one)."""
    known = set(known)
    for name in given:
        if name not in known:
            raise TypeError(f"{owner} got an unexpected {what} {name!r}{_suggest(name, known)}")


def check_passthrough(owner: str, field: str, options: Mapping[str, Any] | None) -> None:
    """Refuse ``model_kwargs`` / ``generate_kwargs`` keys that mean nothing to kvblend."""
    for name in options or {}:
        if name not in GENERATION_OPTIONS:
            raise ValueError(
                f"{owner}: {field} key {name!r} means nothing to kvblend"
                f"{_suggest(name, GENERATION_OPTIONS)} (accepted: {', '.join(GENERATION_OPTIONS)})"
            )


def _layer(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One layer's options without unset (None) values, ``max_tokens`` as ``max_new_tokens``."""
    layer = {k: v for k, v in options.items() if v is not None}
    tokens = layer.pop("max_tokens", None)
    if tokens is not None:
        if layer.get("max_new_tokens", tokens) != tokens:
            raise ValueError(
                f"max_tokens={tokens} and max_new_tokens={layer['max_new_tokens']} {where} "
                "disagree; give one (max_new_tokens is transformers' name for max_tokens)"
            )
        layer["max_new_tokens"] = tokens
    return layer


def decode_options(layers: Sequence[tuple[Mapping[str, Any], str]]) -> dict[str, Any]:
    """Merge option layers, later ones winning, into `BlendEngine.generate` keywords.

    Each layer is ``(options, where)``: typically the fields, ``model_kwargs`` and one call's
    keyword arguments; ``where`` names it in errors. None means "not set" in every layer.
    """
    merged: dict[str, Any] = {}
    for options, where in layers:
        merged.update(_layer(options, where))
    return merged


def check_context_window(
    engine: BlendEngine, prompt: str, max_new_tokens: int, window: int | None
) -> None:
    """Refuse a prompt whose tokens plus ``max_new_tokens`` exceed ``window`` (None: no check)."""
    if window is None:
        return
    tokens = len(engine.encode(prompt))
    if tokens + max_new_tokens > window:
        raise ValueError(
            f"prompt of {tokens} tokens plus max_new_tokens={max_new_tokens} exceeds "
            f"context_window={window}; shorten the prompt or lower max_tokens"
        )


def check_window_fits(owner: str, window: int | None, engine: BlendEngine) -> None:
    """Refuse a ``context_window`` larger than the model's own."""
    if window is not None and window > engine.context_window:
        raise ValueError(
            f"{owner}: context_window={window} is larger than {engine.name}'s "
            f"{engine.context_window} tokens"
        )


class EngineHolder:
    """Pickling and deep copies of a pydantic adapter with an ``engine`` field.

    An engine holds a model, locks and open stores, so it is never pickled: the pickle keeps
    the engine's model spec (in ``model``) and the unpickled adapter loads the engine of that
    spec on first use, sharing the one already loaded in the process if there is one. A deep
    copy shares the live engine. Neither touches the original object.
    """

    #: Private attributes reset in a pickled state (besides the lazily loaded ``_engine``).
    _UNPICKLED_PRIVATE: ClassVar[tuple[str, ...]] = ()

    def __getstate__(self) -> dict[Any, Any]:
        state = pydantic.BaseModel.__getstate__(self)  # type: ignore[arg-type]
        fields = dict(state["__dict__"])
        engine = fields.get("engine") or getattr(self, "_engine", None)
        if engine is not None:
            spec = getattr(engine, "model_spec", None)
            if spec is None:
                raise TypeError(
                    f"cannot pickle {type(self).__name__}: its engine wraps a model built in "
                    "memory, which cannot be reloaded; build it with BlendEngine.from_pretrained"
                )
            fields["engine"] = None
            fields["model"] = fields.get("model") or spec
        private = dict(state.get("__pydantic_private__") or {})
        for name in ("_engine", *self._UNPICKLED_PRIVATE):
            if name in private:
                private[name] = _private_default(self, name)
        return {**state, "__dict__": fields, "__pydantic_private__": private}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        pydantic.BaseModel.__setstate__(self, state)  # type: ignore[arg-type]

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Any:
        memo = {} if memo is None else memo
        for engine in (getattr(self, "engine", None), getattr(self, "_engine", None)):
            if engine is not None:
                memo[id(engine)] = engine  # shared, never copied
        for name in self._UNPICKLED_PRIVATE:
            value = (self.__pydantic_private__ or {}).get(name)  # type: ignore[attr-defined]
            if value is not None:
                memo[id(value)] = _private_default(self, name)
        return pydantic.BaseModel.__deepcopy__(self, memo)  # type: ignore[type-var]


def _private_default(owner: Any, name: str) -> Any:
    """Return a fresh default of private attribute ``name`` of ``owner``'s class."""
    return type(owner).__private_attributes__[name].get_default(call_default_factory=True)


def _device(device: int | str | None, device_map: str | Mapping[str, Any] | None) -> str:
    """Return the one device an engine runs on, from HF-style ``device`` / ``device_map``."""
    if isinstance(device_map, Mapping):
        places = {str(place) for place in device_map.values()}
        if len(places) != 1:
            raise ValueError(
                "kvblend runs the whole model on one device; a device_map spreading it over "
                f"{', '.join(sorted(places))} is not supported"
            )
        device_map = places.pop()
    if device is not None and device_map is not None:
        raise ValueError("give device or device_map, not both")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu" if device < 0 else f"cuda:{device}"  # transformers pipelines' convention
    chosen = device_map if device is None else device
    if chosen in (None, "auto"):
        return "auto"
    if chosen in ("balanced", "balanced_low_0", "sequential"):
        raise ValueError(
            f"device_map={chosen!r} spreads the model over devices; kvblend runs it on one "
            "(use 'auto', 'cpu' or 'cuda:N')"
        )
    return str(chosen)


def load_engine(
    model_id: str,
    *,
    device: int | str | None = None,
    device_map: str | Mapping[str, Any] | None = None,
    dtype: Any = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: Mapping[str, Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
) -> BlendEngine:
    """Load ``model_id`` (hub id, folder or GGUF file) into an engine for a ``from_model_id``.

    ``dtype="auto"`` (or None) is kvblend's rule (`kvblend.models.dtypes`: bfloat16 where the
    device has bfloat16 matrix units unless the checkpoint is float32, else float32).
    ``model_kwargs`` go to transformers' ``from_pretrained`` (``torch_dtype`` is read as
    ``dtype``); ``engine_kwargs`` to `BlendEngine` (``store``, ``system_prompt``...).
    """
    loading = dict(model_kwargs or {})
    for key in ("torch_dtype", "dtype"):
        if key in loading:
            if dtype not in (None, "auto"):
                raise ValueError(f"give dtype or model_kwargs[{key!r}], not both")
            dtype = loading.pop(key)
    engine = BlendEngine.from_pretrained(
        model_id,
        device=_device(device, device_map),
        dtype=dtype,
        revision=revision,
        trust_remote_code=trust_remote_code,
        model_kwargs=loading,
        **dict(engine_kwargs or {}),
    )
    adopt_engine(engine)
    return engine
