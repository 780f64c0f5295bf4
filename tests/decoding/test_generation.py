"""Decoding: closing a stream stops it, seeds are per call, stop and sampling inputs are checked."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.store import MemoryKVStore
from kvblend.validation import check_stop, check_text


@pytest.fixture
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


def _prompt() -> list[Segment]:
    return [Segment("Marta lives in Lisbon."), Segment("\nWhere does Marta live?", cache=False)]


class _Words:
    """A forward hook on the LM head: counts its calls and makes greedy text ``"a a a ..."``.

    Pieces of a text stream end at spaces, so this gives one piece every two tokens.
    """

    def __init__(self, engine: BlendEngine) -> None:
        vocab = engine.tokenizer.get_vocab()
        self.ids = (vocab["a"], vocab["Ġ"])  # byte-level "a" and " "
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.calls += 1
            token = self.ids[self.calls % 2]
        output = output.clone()
        output[..., token] = output.abs().max() * 10 + 10
        return output


def test_closing_a_stream_stops_decoding_within_one_token(engine: BlendEngine) -> None:
    words = _Words(engine)
    engine.model.lm_head.register_forward_hook(words)
    pre = engine.prefill(_prompt(), BlendConfig("full"))
    stream = engine.stream(pre, max_new_tokens=600)
    pieces = [next(stream), next(stream)]
    assert all(pieces) and set("".join(pieces)) == {"a", " "}
    at_close = words.calls
    stream.close()
    for thread in threading.enumerate():  # nothing may keep decoding in the background
        if thread.name == "kvblend-decode":
            thread.join()
    assert words.calls - at_close <= 1, f"{words.calls - at_close} tokens decoded after close"
    # the same prompt decoded to the end runs every token: the hook sees them all
    whole = engine.generate(pre, max_new_tokens=40)
    assert set(whole.text) == {"a", " "} and len(whole.token_ids) == 40
    assert whole.finish_reason == "length"


def test_breaking_out_of_a_stream_stops_decoding(engine: BlendEngine) -> None:
    words = _Words(engine)
    engine.model.lm_head.register_forward_hook(words)
    pre = engine.prefill(_prompt(), BlendConfig("full"))
    for piece in engine.stream(pre, max_new_tokens=600):
        assert set(piece) <= {"a", " "}
        break
    for thread in threading.enumerate():
        if thread.name == "kvblend-decode":
            thread.join()
    assert words.calls < 10


def test_seeded_calls_on_threads_repeat_their_text(engine: BlendEngine) -> None:
    pre = engine.prefill(_prompt(), BlendConfig("full"))
    seeds = [seed for _ in range(4) for seed in range(5)]  # 20 calls, each seed 4 times

    def sample(seed: int) -> tuple[int, str]:
        out = engine.generate(pre, max_new_tokens=12, temperature=1.0, seed=seed)
        return seed, out.text

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(sample, seeds))
    by_seed: dict[int, set[str]] = {}
    for seed, text in results:
        by_seed.setdefault(seed, set()).add(text)
    assert all(len(texts) == 1 for texts in by_seed.values()), by_seed
    assert len({next(iter(t)) for t in by_seed.values()}) > 1  # seeds do change the text


def test_seeded_sampling_leaves_the_process_rng_alone(engine: BlendEngine) -> None:
    pre = engine.prefill(_prompt(), BlendConfig("full"))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine.generate(pre, max_new_tokens=4, temperature=1.0, seed=7)
    list(engine.stream(pre, max_new_tokens=4, temperature=0.8, top_p=0.9, seed=7))
    assert torch.equal(torch.rand(3), expected)


def test_seeded_stream_matches_seeded_generate(engine: BlendEngine) -> None:
    pre = engine.prefill(_prompt(), BlendConfig("full"))
    whole = engine.generate(pre, max_new_tokens=12, temperature=1.2, top_p=0.9, seed=11)
    streamed = "".join(engine.stream(pre, max_new_tokens=12, temperature=1.2, top_p=0.9, seed=11))
    assert streamed == whole.text


def test_a_string_stop_is_one_stop_sequence(engine: BlendEngine) -> None:
    pre = engine.prefill(_prompt(), BlendConfig("full"))
    whole = engine.generate(pre, max_new_tokens=16)
    assert len(whole.text) > 6
    absent = whole.text[2:4] + "\u2603never\u2603"  # its characters occur, the sequence does not
    out = engine.generate(pre, max_new_tokens=16, stop=absent)
    assert out.text == whole.text and out.finish_reason == whole.finish_reason
    present = whole.text[3:5]
    cut = engine.generate(pre, max_new_tokens=16, stop=present)
    assert cut.text == whole.text[: whole.text.index(present)] and cut.finish_reason == "stop"
    assert "".join(engine.stream(pre, max_new_tokens=16, stop=present)) == cut.text
    assert "".join(engine.stream(pre, max_new_tokens=16, stop=absent)) == whole.text


@pytest.mark.parametrize("stop", ["", [""], ["ok", ""]])
def test_empty_stop_sequences_are_refused(engine: BlendEngine, stop: object) -> None:
    with pytest.raises(ValueError, match="stop sequences must be non-empty"):
        engine.generate(["q"], max_new_tokens=4, stop=stop)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop sequences must be non-empty"):
        list(engine.stream(["q"], max_new_tokens=4, stop=stop))  # type: ignore[arg-type]


def test_non_string_stop_sequences_are_refused() -> None:
    with pytest.raises(TypeError, match="stop sequences must be str"):
        check_stop([b"x"])  # type: ignore[list-item]
    assert check_stop(("a", "bc", "a")) == ("a", "bc")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"temperature": math.inf}, "temperature must be a finite number"),
        ({"temperature": -0.5}, "temperature must be a finite number"),
        ({"temperature": 1.0, "top_p": math.nan}, r"top_p must be a number in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": math.inf}, r"top_p must be a number in \(0, 1\]"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ],
)
def test_sampling_settings_must_be_finite_and_in_range(
    engine: BlendEngine, setting: dict, message: str
) -> None:
    kwargs = {"max_new_tokens": 4} | setting
    with pytest.raises(ValueError, match=message):
        engine.generate(["q"], **kwargs)


def test_a_lone_surrogate_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"lone surrogate U\+D800 at character 3"):
        check_text("abc\ud800def", "prompt")
    with pytest.raises(ValueError, match="lone surrogate"):
        check_stop(["\udcff"])
    assert check_text("Marta \u2603 Lisbon") == "Marta \u2603 Lisbon"
