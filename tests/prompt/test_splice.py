"""Spliced prompt tokens are the tokenizer's own on the whole text, for every tokenizer family.

`kvblend.prompt.tokens.prompt_tokens` tokenizes only the text between documents and splices in
the documents' memoised tokens (`kvblend.prompt.splice`). Checked here against
``tokenizer(text, return_offsets_mapping=True)`` (ids and character offsets) on the families of
tests/prompt/test_fidelity.py, over adversarial prompts: documents glued to each other and to words
around them, unicode, whitespace runs, special tokens in the text and in documents, documents
at the very start and end; and every prompt whose documents have cuts must splice (no silent
fallback to the whole text).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import byte_tokenizer
from kvblend.prompt.splice import document_cut, splice_rules, spliced_tokens
from kvblend.prompt.tokens import DocumentLayout, document_layout, encode_prompt, prompt_tokens
from test_fidelity import (
    FAMILIES,
    LLAMA3_SPLIT,
    QWEN2_SPLIT,
    mistral_tokenizer,
    smollm2_tokenizer,
    trained_bpe,
)

DOCUMENTS = [
    "The lighthouse at Brno is painted red and white, and its keeper writes a log every night "
    "before the ships come in from the northern sea.",
    "très calme, she said; naïve café owners in Zürich serve crème brûlée daily to the guests "
    "who arrive late from the station on foot.",
    "日本語 text mixed with English words and an emoji 🙂 in the middle of the sentence here, "
    "then more plain words until the end of it.",
    "Whitespace   runs\t\tand\n\n\nnewlines   inside a document   with words around them all "
    "keep going for a while so the cuts land inside.",
    "a ﬁne ligature and combining e\u0301 marks plus ＦＵＬＬＷＩＤＴＨ letters in a long line, "
    "and contractions don't won't it's we'll they're I'm you've she'd",
    "Numbers 12345 and 3.14159 and dates like 2024-05-06 appear between plain words here too, "
    "with code_like_names and CamelCaseWords mixed in.",
    "  leading and trailing whitespace around a document whose words still leave room for "
    "cuts in the middle of it   \n",
    "Short one, no cuts.",
    "ΑΥΤΟ ΕΙΝΑΙ ΕΛΛΗΝΙΚΑ και κυριλλица без латинских букв между словами, только пробелы",
]
GAPS = ["", " ", "\n\n", "Docs:", "pre", "x", "  \n ", "é", "🙂", "\t", " and ", "\n- ", "."]


def family_tokenizer(family: str, folder: Path) -> PreTrainedTokenizerFast:
    """The tokenizer of one family of tests/prompt/test_fidelity.py."""
    if family == "byte":
        return byte_tokenizer()
    if family == "smollm2":
        return smollm2_tokenizer()
    if family == "mistral-v1":
        return mistral_tokenizer("tokenizer.model.v1", folder / "tok")
    if family == "mistral-v3":
        return mistral_tokenizer("mistral_instruct_tokenizer_240323.model.v3", folder / "tok")
    if family == "qwen2-bpe":
        return trained_bpe(QWEN2_SPLIT, bos=None)
    return trained_bpe(LLAMA3_SPLIT, bos="<|begin_of_text|>")


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> PreTrainedTokenizerFast:
    return family_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def specials(tokenizer: PreTrainedTokenizerFast) -> list[str]:
    """Special tokens of the tokenizer, written into texts."""
    return [token for token in (tokenizer.eos_token, tokenizer.pad_token) if token]


def random_prompt(
    rng: random.Random, documents: list[str], gaps: list[str]
) -> tuple[str, list[tuple[int, int]]]:
    """A prompt of gaps and documents (some glued, repeated, first or last); their spans."""
    text, spans = rng.choice(["", "", *gaps]), []
    for _ in range(rng.randint(1, 4)):
        document = rng.choice(documents)
        spans.append((len(text), len(text) + len(document)))
        text += document + rng.choice(gaps)
    return text, spans


def expected(tokenizer: PreTrainedTokenizerFast, text: str) -> tuple[list[int], list[list[int]]]:
    """``tokenizer(text)``'s ids and offsets (``encode_prompt``'s, when a BOS starts the text)."""
    bos = tokenizer.bos_token
    if bos and text.startswith(bos):
        tokens = encode_prompt(tokenizer, text)
        assert tokens.ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokens.ids.tolist(), tokens.offsets.tolist()
    encoded = tokenizer(text, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [list(pair) for pair in encoded["offset_mapping"]]


def test_every_family_of_the_suite_splices(tokenizer: PreTrainedTokenizerFast) -> None:
    """Every tokenizer family the suite covers has splice rules (else nothing here is tested)."""
    rules = splice_rules(tokenizer)
    assert rules is not None
    assert splice_rules(tokenizer) is rules  # read once
    layout = document_layout(tokenizer, "Documents:\n\n", DOCUMENTS[0])
    assert layout.cut is not None and layout.cut.last - layout.cut.first > 10


@pytest.mark.parametrize("context", ["", "Documents:\n\n"])
def test_spliced_tokens_equal_the_tokenizer_on_adversarial_prompts(
    tokenizer: PreTrainedTokenizerFast, context: str
) -> None:
    rng = random.Random(len(context))
    gaps = [*GAPS, *specials(tokenizer)]
    documents = [*DOCUMENTS, f"{DOCUMENTS[0][:60]}{specials(tokenizer)[0]}{DOCUMENTS[1][:80]}"]
    layouts = {text: document_layout(tokenizer, context, text) for text in documents}
    assert layouts[documents[-1]].cut is None  # a special token inside: never spliced
    spliced_count = 0
    for _ in range(60):
        text, spans = random_prompt(rng, documents, gaps)
        if rng.random() < 0.2 and tokenizer.bos_token:
            text = tokenizer.bos_token + text
            spans = [(start + len(tokenizer.bos_token), end + len(tokenizer.bos_token))
                     for start, end in spans]  # fmt: skip
        by_span = {span: layouts[text[span[0] : span[1]]] for span in spans}
        tokens = prompt_tokens(tokenizer, text, by_span)
        ids, offsets = expected(tokenizer, text)
        assert tokens.ids.tolist() == ids, text
        assert tokens.offsets.tolist() == offsets, text
        cuts = [(start, lay.cut, lay.tokens.ids, lay.tokens.offsets)
                for (start, _), lay in by_span.items() if lay.cut is not None]  # fmt: skip
        if cuts:
            bos = tokenizer.bos_token
            adds = not (bos and text.startswith(bos))
            assert spliced_tokens(tokenizer, text, cuts, adds) is not None, text
            spliced_count += 1
    assert spliced_count > 30


def test_documents_without_cuts_and_tokenizers_without_rules_tokenize_the_whole_text() -> None:
    """A WordPiece tokenizer, or an unknown pre-tokenizer rule, has no rules: whole text."""
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "##b": 3, "word": 4}
    wordpiece = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    unknown = byte_tokenizer()
    unknown.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel()]
    )
    for tokenizer in (PreTrainedTokenizerFast(tokenizer_object=wordpiece), unknown):
        assert splice_rules(tokenizer) is None
        text = f"a b {DOCUMENTS[0]} word"
        layout = document_layout(tokenizer, "", DOCUMENTS[0])
        assert layout.cut is None
        tokens = prompt_tokens(tokenizer, text, {(4, 4 + len(DOCUMENTS[0])): layout})
        assert tokens.ids.tolist() == tokenizer(text)["input_ids"]


def test_a_changed_tokenizer_splices_no_cut_found_before() -> None:
    """Cuts found under one pipeline are not used once the tokenizer's pipeline changes."""
    tokenizer = byte_tokenizer()
    layout = document_layout(tokenizer, "", DOCUMENTS[0])
    assert layout.cut is not None
    tokenizer.add_tokens(["lighthouse at"])  # an added token now spans a cut of the document
    text = f"Docs: {DOCUMENTS[0]} end"
    stale = (6, layout.cut, layout.tokens.ids, layout.tokens.offsets)
    assert spliced_tokens(tokenizer, text, [stale], True) is None
    tokens = prompt_tokens(tokenizer, text, {(6, 6 + len(DOCUMENTS[0])): layout})
    assert tokens.ids.tolist() == tokenizer(text)["input_ids"]


def test_a_cut_is_refused_where_the_layout_has_no_token_boundary() -> None:
    """`document_cut` checks the document's own tokens: offsets crossing a cut refuse it."""
    tokenizer = byte_tokenizer()
    rules = splice_rules(tokenizer)
    assert rules is not None
    text = DOCUMENTS[0]
    starts = np.arange(len(text), dtype=np.int64)
    assert document_cut(rules, text, starts, starts + 1) is not None
    ends = starts + 5  # every token overlaps the next four characters
    assert document_cut(rules, text, starts, ends) is None
    layout = DocumentLayout([], list(range(len(text))), np.stack([starts, ends], axis=1))
    assert layout.cut is None and layout.tokens.ids.size == len(text)


def test_the_engine_splices_a_string_prompt_without_tokenizing_its_documents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`BlendEngine.plan` on a string: the documents are found, never tokenized again."""
    import kvblend.prompt.tokens as tokens_module
    from conftest import tiny_model
    from kvblend import BlendEngine
    from kvblend.store import MemoryKVStore

    tokenizer = byte_tokenizer()
    engine = BlendEngine(tiny_model("llama"), tokenizer, store=MemoryKVStore(), name="tiny")
    engine.register(DOCUMENTS[:3])
    prompt = f"Docs:\n{DOCUMENTS[2]}\n\n{DOCUMENTS[0]}{DOCUMENTS[1]} Which is red?"
    first = engine.plan(prompt)  # every document's layout made (and memoised) here
    encoded: list[int] = []
    whole = tokens_module.encode_prompt
    monkeypatch.setattr(
        tokens_module, "encode_prompt", lambda *args: encoded.append(1) or whole(*args)
    )
    plan = engine.plan(prompt)
    assert not encoded  # no whole-text tokenization: spliced
    assert plan.token_ids.tolist() == first.token_ids.tolist() == tokenizer(prompt)["input_ids"]
    assert plan.kinds.dtype == np.int8 and plan.token_ids.dtype == np.int64
    assert sum(row.reused > 0 for row in plan.report if row.role == "document") == 3


def test_a_token_added_with_an_id_the_vocabulary_has_splices_no_cut_found_before() -> None:
    """An added token already in the vocabulary changes no size, yet how documents tokenize."""
    tokenizer = trained_bpe(QWEN2_SPLIT, bos=None)
    layout = document_layout(tokenizer, "", DOCUMENTS[0])
    assert layout.cut is not None
    size = len(tokenizer)
    tokenizer.add_tokens(["e"])  # a vocabulary token, from now on split out of every word
    assert len(tokenizer) == size
    text = f"Docs: {DOCUMENTS[0]} end"
    stale = (6, layout.cut, layout.tokens.ids, layout.tokens.offsets)
    assert spliced_tokens(tokenizer, text, [stale], True) is None
    tokens = prompt_tokens(tokenizer, text, {(6, 6 + len(DOCUMENTS[0])): layout})
    assert tokens.ids.tolist() == tokenizer(text)["input_ids"]


def test_an_added_token_made_normalized_takes_the_rules_away(tmp_path: Path) -> None:
    """Re-adding a special token as ``normalized`` keeps every size, but it matches normalized
    text now, where the documents' text does not show it: no splicing under a normalizer."""
    from tokenizers import AddedToken

    tokenizer = mistral_tokenizer("tokenizer.model.v1", tmp_path / "tok")
    assert splice_rules(tokenizer) is not None
    size = len(tokenizer)
    tokenizer.backend_tokenizer.add_special_tokens([AddedToken("</s>", normalized=True)])
    assert len(tokenizer) == size
    assert splice_rules(tokenizer) is None


def test_special_tokens_are_read_as_the_tokenizer_reads_them_after_a_call_that_split_them() -> None:
    """``tokenizer(text, split_special_tokens=True)`` leaves its Rust tokenizer reading special
    tokens' text as plain text; the prompt's ids are still ``tokenizer(prompt)``'s."""
    tokenizer = trained_bpe(QWEN2_SPLIT, bos=None)
    text = f"Docs:</s> {DOCUMENTS[0]} </s>end"
    layouts = {(9, 9 + len(DOCUMENTS[0])): document_layout(tokenizer, "", DOCUMENTS[0])}
    expected_ids = tokenizer(text)["input_ids"]
    assert tokenizer.eos_token_id in expected_ids
    tokenizer("untrusted </s> text", split_special_tokens=True)
    assert encode_prompt(tokenizer, text).ids.tolist() == expected_ids
    tokenizer("untrusted </s> text", split_special_tokens=True)
    assert prompt_tokens(tokenizer, text, layouts).ids.tolist() == expected_ids
    tokenizer.split_special_tokens = True  # the tokenizer's own setting is followed
    split_ids = encode_prompt(tokenizer, text).ids.tolist()
    assert split_ids == tokenizer(text)["input_ids"] != expected_ids
    assert prompt_tokens(tokenizer, text, layouts).ids.tolist() == split_ids
