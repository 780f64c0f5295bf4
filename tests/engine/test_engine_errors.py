"""Bad input gets a clear error, and nothing is half-done."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import byte_tokenizer, tiny_model
from kvblend import (
    BlendConfig,
    BlendEngine,
    BlendUnavailableError,
    ModelNotFoundError,
    Segment,
    UnsupportedModelError,
)
from kvblend.store import MemoryKVStore


@pytest.fixture
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


def test_empty_segment_list(engine: BlendEngine) -> None:
    with pytest.raises(ValueError, match="segment list is empty"):
        engine.prefill([])


def test_empty_text() -> None:
    with pytest.raises(ValueError, match="empty"):
        Segment("")


def test_precompute_rejects_empty_text_before_doing_any_work(engine: BlendEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.precompute(["fine text", ""])
    assert not engine.is_known("fine text") and len(engine.library.registry) == 0


def test_non_string_text() -> None:
    with pytest.raises(TypeError, match="str"):
        Segment(42)  # type: ignore[arg-type]


def test_prefix_after_document(engine: BlendEngine) -> None:
    with pytest.raises(ValueError, match="prefix segments must come before"):
        engine.prefill([Segment("doc"), Segment("system", role="prefix")])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "magic"}, "unknown strategy 'magic'"),
        ({"recompute_ratio": 1.5}, r"recompute_ratio must be a number in \[0, 1\]"),
        ({"recompute_ratio": -0.1}, r"recompute_ratio must be a number in \[0, 1\]"),
        ({"strategy": "cacheblend", "deviation": "query"}, "unknown deviation metric"),
        ({"strategy": "cacheblend", "check_layer": -1}, "check_layer must be an int >= 1"),
        ({"strategy": "cacheblend", "check_layer": 0}, "no deviation to measure"),
        (
            {"strategy": "cacheblend", "ratio_schedule": ((0, 0.3), (2, 0.1))},
            "layers must be increasing ints >= 1",
        ),
        (
            {"strategy": "cacheblend", "ratio_schedule": ((2, 0.3), (1, 0.1))},
            "layers must be increasing",
        ),
        ({"strategy": "cacheblend", "ratio_schedule": ((1, 0.1), (2, 0.3))}, "must not increase"),
        ({"strategy": "epic", "epic_tokens": -3}, "epic_tokens"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlendConfig(**kwargs)


def test_config_is_frozen() -> None:
    config = BlendConfig()
    with pytest.raises(AttributeError):
        config.recompute_ratio = 0.5  # type: ignore[misc]


def test_check_layer_outside_model(engine: BlendEngine) -> None:
    with pytest.raises(ValueError, match="check layer 7 is outside the model, which has 3 layers"):
        engine.prefill(["question"], BlendConfig("cacheblend", check_layer=7))


def test_prompt_longer_than_context(engine: BlendEngine) -> None:
    with pytest.raises(ValueError, match="longer than .* context window of 1024 tokens"):
        engine.prefill([Segment("x" * 2000, cache=False)])


def test_unsupported_architecture_is_named() -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=259)).eval()
    with pytest.raises(UnsupportedModelError, match="gpt2.*GPT2LMHeadModel"):
        BlendEngine(gpt2, byte_tokenizer(), store=MemoryKVStore())


def test_parity_failure_refuses_to_blend(engine: BlendEngine) -> None:
    engine.decoder.scaling *= 1.5  # a layer loop that no longer matches the model
    assert engine.check_parity() > 1e-4
    with pytest.raises(BlendUnavailableError, match="refusing to blend"):
        engine.prefill([Segment("doc"), Segment("q", cache=False)], BlendConfig("cacheblend"))


def test_generation_arguments_are_checked(engine: BlendEngine) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(["q"], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(["q"], temperature=-1.0)


def test_sampling_is_seeded(engine: BlendEngine) -> None:
    first = engine.generate(["hello"], temperature=1.0, max_new_tokens=8, seed=3)
    second = engine.generate(["hello"], temperature=1.0, max_new_tokens=8, seed=3)
    assert first.token_ids == second.token_ids


def test_missing_model_path_is_clear() -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        BlendEngine.from_pretrained("./no/such/folder", store=MemoryKVStore())


def test_unknown_dtype_is_clear() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        BlendEngine.from_pretrained("./x", dtype="fp8", store=MemoryKVStore())


def test_kv_dtype_is_honoured_in_the_store() -> None:
    store = MemoryKVStore()
    engine = BlendEngine(
        tiny_model("qwen2"), byte_tokenizer(), store=store, kv_dtype=torch.bfloat16
    )
    (key,) = engine.precompute(["a document"])
    entry = store.get(key)
    assert entry is not None and entry["kv"].dtype == torch.bfloat16
    pre = engine.prefill([Segment("a document"), Segment("?", cache=False)])
    assert torch.isfinite(pre.logits).all()


def test_a_huge_prompt_is_refused_before_it_is_tokenized(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    tokenizer_call = type(engine.tokenizer).__call__

    def counting(self, text, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(len(text) if isinstance(text, str) else 0)
        return tokenizer_call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(engine.tokenizer), "__call__", counting)
    with pytest.raises(ValueError, match="context window"):
        engine.prefill("x" * (engine.context_window * 300), BlendConfig("full"))
    assert all(length < 1000 for length in calls)  # only short texts were tokenized


def test_a_lone_surrogate_is_one_clear_error(engine: BlendEngine) -> None:
    with pytest.raises(ValueError, match="lone surrogate U\\+DC80"):
        engine.prefill("bad \udc80 text", BlendConfig("full"))
    with pytest.raises(ValueError, match="lone surrogate"):
        Segment("bad \udc80 text")


# ------------------------------------------------------------------ refusals before model work
class Work:
    """Counts every module forward of the engine's model and every tokenizer call."""

    def __init__(self, engine: BlendEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.forwards = 0
        self.tokenizations = 0
        for module in engine.model.modules():
            module.register_forward_pre_hook(self._forward)
        original = type(engine.tokenizer).__call__

        def counting(tokenizer, *args, **kwargs):
            self.tokenizations += 1
            return original(tokenizer, *args, **kwargs)

        monkeypatch.setattr(type(engine.tokenizer), "__call__", counting)

    def _forward(self, module, args) -> None:
        self.forwards += 1

    @property
    def none(self) -> bool:
        return self.forwards == 0 and self.tokenizations == 0


BAD_GENERATION = [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be at least 1"),
    ({"max_new_tokens": -5}, ValueError, "max_new_tokens must be at least 1"),
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens must be an int"),
    ({"temperature": -0.1}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": float("inf")}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": "0.7"}, TypeError, "temperature must be a number"),
    ({"top_p": 0.0}, ValueError, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": 1.5}, ValueError, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": float("nan")}, ValueError, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": None}, TypeError, "top_p must be a number"),
    ({"seed": -1}, ValueError, r"seed must be in 0..2\*\*64-1"),
    ({"seed": 2**64}, ValueError, r"seed must be in 0..2\*\*64-1"),
    ({"seed": 2**70}, ValueError, r"seed must be in 0..2\*\*64-1"),
    ({"seed": 1.5}, TypeError, "seed must be an int or None"),
    ({"seed": "7"}, TypeError, "seed must be an int or None"),
    ({"stop": ""}, ValueError, "stop sequences must be non-empty"),
    ({"stop": [3]}, TypeError, "stop sequences must be str"),
    ({"stop": {"x"}}, TypeError, "stop must be a str or a list of str"),
    ({"stop": ["x" * 10_000]}, ValueError, "has 10,000 characters"),
    ({"stop": [f"s{i}" for i in range(33)]}, ValueError, "too many stop sequences: 33"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_GENERATION)
@pytest.mark.parametrize("call", ["generate", "stream"])
def test_bad_generation_arguments_are_refused_before_any_model_work(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch, call: str, kwargs, error, message
) -> None:
    work = Work(engine, monkeypatch)
    with pytest.raises(error, match=message) as raised:
        if call == "generate":
            engine.generate("Docs: a prompt long enough.\nQ?", **kwargs)
        else:
            next(iter(engine.stream("Docs: a prompt long enough.\nQ?", **kwargs)))
    assert "\n" not in str(raised.value)  # one line
    assert work.none


def test_good_generation_arguments_at_the_bounds_decode(engine: BlendEngine) -> None:
    result = engine.generate(
        "Docs: a prompt.\nQ?", max_new_tokens=1, temperature=0.5, top_p=1.0,
        seed=2**64 - 1, stop=[f"s{i}" for i in range(31)] + ["x" * 200],
    )  # fmt: skip
    assert len(result.token_ids) <= 1


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda e: e.prefill("a prompt", "reuse"), TypeError, "config must be a BlendConfig"),
        (lambda e: e.prefill(42), TypeError, "prompt must be a str or a list of segments"),
        (lambda e: e.prefill(["ok", 3]), TypeError, "Segment text must be a str"),
        (lambda e: e.precompute(["fine text", 7]), TypeError, r"texts\[1\] must be a str, got int"),
        (lambda e: e.precompute(["fine text", ""]), ValueError, "document 1: Segment text"),
        (lambda e: e.precompute(5), TypeError, "texts must be a list of str, got int"),
        (lambda e: e.precompute(["a"], batch_tokens="8"), TypeError, "batch_tokens must be an int"),
        (lambda e: e.precompute(["a"], force="yes"), TypeError, "force must be True or False"),
        (lambda e: e.register(3), TypeError, "texts must be a list of str, got int"),
        # a str as the document list would be one document per character
        (
            lambda e: e.rag_segments("q?", "one document"),
            TypeError,
            r"documents must be a list of str, got a single str \(pass \[text\] for one document\)",
        ),
        (lambda e: e.rag_segments("q?", ["a", 3]), TypeError, r"documents\[1\] must be a str"),
        (lambda e: e.rag_segments("q?", ["a", ""]), ValueError, r"documents\[1\] is empty"),
        (lambda e: e.rag_segments(3, ["a"]), TypeError, "the question must be a str, got int"),
        (lambda e: e.rag_segments(" ", ["a"]), ValueError, "the question is empty"),
        (lambda e: e.rag_segments("q?", ["a"], separator=""), ValueError, "separator is empty"),
        # cancel is checked before the prefill starts, on every entry point that takes it
        (
            lambda e: e.generate(e.rag_segments("q?", ["a doc"]), cancel="yes"),
            TypeError,
            "cancel must be a threading.Event or None, got str",
        ),
        (lambda e: e.prefill("a prompt", cancel="yes"), TypeError, "cancel must be a threading"),
        (lambda e: next(iter(e.stream("a prompt", cancel=1))), TypeError, "cancel must be a"),
        (lambda e: e.generate("a prompt", "full"), TypeError, "config must be a BlendConfig"),
        (lambda e: e.explain("a prompt", "reuse"), TypeError, "config must be a BlendConfig"),
        (lambda e: e.explain(42), TypeError, "prompt must be a str or a list of segments"),
        (lambda e: e.generate_batch("a prompt"), TypeError, "prompts must be a list of prompts"),
        (lambda e: e.generate_batch(["ok", 3]), TypeError, "prompt must be a str or a list"),
        (lambda e: e.tokenize(5), TypeError, "text must be a str, got int"),
        (lambda e: e.encode(b"x"), TypeError, "prompt must be a str, got bytes"),
        (lambda e: e.segment_id(None), TypeError, "text must be a str, got NoneType"),
        (lambda e: e.apply_chat_template("hi"), TypeError, "messages must be a list of"),
    ],  # fmt: skip
)
def test_bad_prompts_and_configs_are_refused_before_any_model_work(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch, call, error, message
) -> None:
    work = Work(engine, monkeypatch)
    with pytest.raises(error, match=message):
        call(engine)
    assert work.none


def test_a_huge_document_is_refused_from_its_length_alone(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    huge = "Lorem ipsum dolor sit amet. " * (10 * 2**20 // 28)  # 10 MiB
    work = Work(engine, monkeypatch)
    with pytest.raises(ValueError) as raised:
        engine.precompute(["A short document that fits.", huge])
    text = str(raised.value)
    assert text.startswith("document 1 ('Lorem ipsum dolor sit amet. Lorem ipsum")
    assert "10,485," in text and "context window of 1024 tokens" in text and "\n" not in text
    assert work.none and len(engine.library.registry) == 0
    with pytest.raises(ValueError, match="prompt of 10,485,"):
        engine.generate(f"Docs: {huge}\nQ?")  # nor searched, nor tokenized
    assert work.none


def test_a_document_over_the_window_in_tokens_is_named_before_any_forward(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    over = "word " * 300  # 1,500 characters: under the character bound, over 1024 tokens
    work = Work(engine, monkeypatch)
    with pytest.raises(ValueError, match=r"document 2 \('word word .* of 1,5\d\d tokens"):
        engine.precompute(["first document text", "second document text", over])
    assert work.forwards == 0 and len(engine.library.registry) == 0
