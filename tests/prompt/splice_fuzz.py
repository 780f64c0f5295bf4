"""Random RAG prompts for checking spliced prompt tokens against the tokenizer (a fuzzer).

`kvblend.prompt.splice` tokenizes only the text between known documents and splices in each
document's memoised tokens. This module builds prompts in the shapes real applications build
(a chat template with a system prompt, LangChain's ``"\\n\\n".join`` in a PromptTemplate,
LlamaIndex's text QA template with ``get_content(MetadataMode.LLM)`` metadata lines,
``Document [i](Title: ...)`` labels, documents glued, repeated or truncated, a question quoting a
document) over documents made adversarial (unicode next to cuts, NFKC-changing characters,
whitespace runs, numbers, contractions, special tokens' text, edges mid-word, very short and very
long documents), and `check_prompt` compares an engine's plan with ``tokenizer(prompt)``.

A larger run than the suite's: ``python tests/prompt/splice_fuzz.py --prompts 400 --nq NQ.jsonl.gz``
(tests/prompt/test_splice_fuzz.py documents it).
"""

from __future__ import annotations

import gzip
import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from kvblend import BlendEngine
from kvblend.prompt.plan import cached_pieces, plan_prefill
from kvblend.prompt.splice import CUT, splice_rules, spliced_tokens
from kvblend.prompt.tokens import document_layout, encode_prompt, prompt_tokens

#: Wikipedia-style passages, so the suite needs no data file (``--nq`` reads real ones).
PASSAGES = [
    ("Brno Lighthouse", "The Brno lighthouse is a fictional tower painted red and white. Its "
     "keeper writes a log every night before the ships come in from the northern sea, and the "
     "lamp was converted to electricity in 1931 after a storm broke the old lens."),
    ("Copperleaf", "Copperleaf Ltd. was founded by Ada Moss in 1999 in Zürich; it makes crème "
     "brûlée moulds, 12,500 of them a year, and its café serves naïve visitors who don't know it "
     "isn't a bakery. The company's motto, 'très calme', is painted on its door."),
    ("Room 12", "Room 12 hosts the 9:30 meeting every Tuesday. The meeting was moved there in "
     "March 2021 because the old room (Room 7) had no windows; attendance rose from 14 to 23 "
     "people within a month, according to the minutes."),
    ("Harbour of Tallin", "The harbour handled 3.2 million tonnes of cargo in 2019, most of it "
     "timber and grain. Ferries leave for Helsinki every two hours, and the crossing takes about "
     "two hours and fifteen minutes in calm weather."),
    ("Snow leopard", "The snow leopard (Panthera uncia) lives in the mountain ranges of Central "
     "and South Asia. It is listed as Vulnerable on the IUCN Red List because the global "
     "population is estimated to number fewer than 10,000 mature individuals."),
    ("Tokyo Station", "Tokyo Station (東京駅, Tōkyō-eki) is a railway station in Chiyoda, Tokyo. "
     "It is the main intercity rail terminal in Tokyo and the busiest station in Japan in terms "
     "of trains per day, with over 3,000 trains a day."),
]  # fmt: skip

SYSTEM = "You are a helpful assistant. Answer using the documents."
LANGCHAIN = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't "
    "know.\nQuestion: {question} \nContext: {context} \nAnswer:"
)
LLAMAINDEX = (
    "Context information is below.\n---------------------\n{context}\n---------------------\n"
    "Given the context information and not prior knowledge, answer the query.\n"
    "Query: {question}\nAnswer: "
)
LOST_IN_THE_MIDDLE = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant).\n\n{context}\n\nQuestion: {question}\nAnswer:"
)
#: Text that tokenizes unusually: combining marks, NFKC-changing characters (ligatures,
#: fullwidth letters, compatibility digits), RTL, emoji ZWJ sequences, CJK, whitespace, digits,
#: contractions.
FRAGMENTS = [
    "\u0301", "e\u0301", "\u0308\u0301", "ﬁ", "ﬀ", "ﬃ", "Ｆｕｌｌ", "ｗ", "①", "㎏", "²", "ǆ", "Å",
    "K", "ß", "İ", "ſ", "¨", "\u00a0", "\u2009", "\u200b", "\u200d", "\ufeff", "\u2028",
    "שלום עולם", "مرحبا بالعالم", "\u202e", "👩\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "🙂",
    "日本語", "中文字符", "한국어", "ไทย", " ", "  ", "   ", "\t", "\t\t", "\r\n", "\r", "\n",
    "\n\n", "\n\n\n", " \n ", "1", "12", "123", "1234", "1234567", "3.14159", "2,000,000",
    "'s", "'S", "'ll", "'t", "'RE", "it's", "don't", "’s", "\"", "'", "-", "_", "...", "a", "x",
    "I", "Q", "word",
]  # fmt: skip
GAPS = ["", " ", "\n", "\n\n", "\n\n\n", "\r\n", "\t", "  ", " \n ", "Docs:", "x", ".", "é",
        "🙂", " and ", "\n- ", "1", "'s ", "日本"]  # fmt: skip


def load_passages(path: str | Path | None, count: int, rng: random.Random) -> list[tuple[str, str]]:
    """``count`` (title, text) passages of an NQ jsonl(.gz), or the built-in ones."""
    if path is None:
        return list(PASSAGES)
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    unique = list({record["text"]: record["title"] for record in records}.items())
    return [(title, text) for text, title in rng.sample(unique, min(count, len(unique)))]


def special_texts(tokenizer: Any) -> list[str]:
    """Texts of the tokenizer's added tokens (some), with pieces of them."""
    added = sorted(token.content for token in tokenizer.added_tokens_decoder.values())
    chosen = added[:4] + added[-4:]
    return chosen + [text[: len(text) // 2] for text in chosen] + [text[1:] for text in chosen]


def _near_cut(rng: random.Random, text: str) -> int:
    """A position next to a cut (a space between ASCII letters) of ``text``, or anywhere."""
    cuts = [match.start() for match in CUT.finditer(text)]
    if not cuts:
        return rng.randint(0, len(text))
    return min(len(text), rng.choice(cuts) + rng.choice([-1, 0, 1, 2]))


def mutate(rng: random.Random, text: str, extra: list[str]) -> str:
    """An adversarial variant of a document: fragments at its edges, next to cuts, mid-word."""
    pool = FRAGMENTS + extra
    kind = rng.randrange(7)
    if kind == 0:  # edges: whitespace, unicode, special tokens' text
        return rng.choice(pool) + text + rng.choice(pool)
    if kind == 1:  # truncated mid-word at both ends
        low = rng.randint(0, len(text) // 3)
        return text[low : rng.randint(max(low + 1, 2 * len(text) // 3), len(text))]
    if kind == 2:  # very short
        return "".join(rng.choice(pool + ["a b", "word word"]) for _ in range(rng.randint(1, 4)))
    if kind == 3:  # whitespace runs instead of single spaces
        return re.sub(" ", lambda _: rng.choice([" ", " ", "  ", "\t", "\u00a0", " \n"]), text)
    for _ in range(rng.randint(1, 6)):  # fragments right next to cuts
        at = _near_cut(rng, text)
        text = text[:at] + rng.choice(pool) + text[at:]
    return text


def make_documents(
    rng: random.Random, passages: list[tuple[str, str]], tokenizer: Any, count: int
) -> list[tuple[str, str]]:
    """(title, text) documents: passages as they are, mutated, and a few very long ones."""
    extra = special_texts(tokenizer)
    documents = list(passages)
    while len(documents) < count:
        title, text = rng.choice(passages)
        if rng.random() < 0.1:
            text = " ".join(rng.choice(passages)[1] for _ in range(rng.randint(3, 8)))
        documents.append((title, mutate(rng, text, extra)))
    return [(title, text) for title, text in documents if text]


def _question(rng: random.Random, documents: list[tuple[str, str]]) -> str:
    """A question, sometimes quoting a document's first words."""
    if rng.random() < 0.3:
        words = rng.choice(documents)[1].split(" ")[: rng.randint(1, 8)]
        return f'What does "{" ".join(words)}" refer to?'
    return rng.choice(["who founded it?", "When is the meeting?", "how many trains a day"])


def _chat(tokenizer: Any, system: str, user: str) -> str:
    from kvblend.prompt.templates import apply_chat_template

    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    try:
        return apply_chat_template(tokenizer, messages)
    except Exception:  # a template without a system role (Mistral's)
        return apply_chat_template(tokenizer, messages[1:])


def build_prompt(
    rng: random.Random, tokenizer: Any, documents: list[tuple[str, str]], specials: list[str]
) -> tuple[str, str]:
    """A prompt over some of ``documents`` in one of the shapes real apps build; its shape."""
    chosen = rng.sample(documents, rng.randint(1, min(6, len(documents))))
    if rng.random() < 0.2:  # a document repeated
        chosen.insert(rng.randrange(len(chosen) + 1), rng.choice(chosen))
    if rng.random() < 0.15:  # a document truncated (still known or not)
        at = rng.randrange(len(chosen))
        title, text = chosen[at]
        chosen[at] = (title, text[: rng.randint(1, len(text))])
    texts = [text for _, text in chosen]
    question = _question(rng, chosen)
    shape = rng.choice(["chat", "langchain", "llamaindex", "lost", "glued", "random"])
    if shape == "chat":
        user = "Documents:\n\n" + "\n\n".join(texts) + f"\n\nQuestion: {question}"
        prompt = _chat(tokenizer, rng.choice([SYSTEM, "", "Be brief."]), user)
    elif shape == "langchain":
        prompt = LANGCHAIN.format(question=question, context="\n\n".join(texts))
    elif shape == "llamaindex":
        nodes = [f"title: {title}\nfile_path: data/nq.jsonl\n\n{text}" for title, text in chosen]
        prompt = LLAMAINDEX.format(question=question, context="\n\n".join(nodes))
    elif shape == "lost":
        labelled = [f"Document [{i + 1}](Title: {t}) {text}" for i, (t, text) in enumerate(chosen)]
        prompt = LOST_IN_THE_MIDDLE.format(question=question, context="\n".join(labelled))
    elif shape == "glued":
        prompt = "".join(texts) + question
    else:
        gaps = GAPS + FRAGMENTS + specials
        prompt = rng.choice(["", *gaps]) + "".join(t + rng.choice(gaps) for t in texts)
    if rng.random() < 0.1 and tokenizer.bos_token and not prompt.startswith(tokenizer.bos_token):
        prompt = tokenizer.bos_token + prompt
    return prompt, shape


def expected_tokens(tokenizer: Any, text: str) -> tuple[list[int], list[list[int]]]:
    """``tokenizer(text)``'s ids and offsets; none added to a text starting with BOS."""
    bos = tokenizer.bos_token
    add = not (bos and text.startswith(bos))
    encoded = tokenizer(text, add_special_tokens=add, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [list(pair) for pair in encoded["offset_mapping"]]


def check_prompt(engine: BlendEngine, prompt: str, counts: Counter[str]) -> None:
    """Assert the engine's plan of ``prompt`` reads ``tokenizer(prompt)``'s ids, consistently.

    The plan's ids equal the tokenizer's on the whole text; the spliced ids and offsets equal
    the whole text's; the plan equals the plan made from the whole text's tokens; every reused
    span's ids are its cached ids. ``counts`` tallies prompts spliced and fallen back.
    """
    tokenizer = engine.tokenizer
    ids, offsets = expected_tokens(tokenizer, prompt)
    plan = engine.plan(prompt)
    assert plan.token_ids.tolist() == ids, ("plan ids", prompt)
    segments = engine.segments_for(prompt)
    pieces = cached_pieces(segments)
    layouts = {(p.start, p.end): engine.library.segment_kv.layout(prompt[p.start : p.end])
               for p in pieces}  # fmt: skip
    tokens = prompt_tokens(tokenizer, prompt, layouts)
    assert tokens.ids.tolist() == ids and tokens.offsets.tolist() == offsets, ("tokens", prompt)
    whole = encode_prompt(tokenizer, prompt)
    reference = plan_prefill(whole, pieces, lambda start, end: layouts[start, end])
    assert np.array_equal(plan.kinds, reference.kinds), ("kinds", prompt)
    assert plan.spans == reference.spans, ("spans", prompt)
    for span in plan.spans:
        cached = span.cached_ids[span.cached_start : span.cached_start + span.end - span.start]
        assert plan.token_ids[span.start : span.end].tolist() == cached, ("span", prompt)
    cuts = [(start, layout.cut, layout.tokens.ids, layout.tokens.offsets)
            for (start, _), layout in layouts.items() if layout.cut is not None]  # fmt: skip
    counts["prompts"] += 1
    counts["documents"] += len(layouts)
    counts["documents with cuts"] += len(cuts)
    counts["reused spans"] += len(plan.spans)
    if not cuts or splice_rules(tokenizer) is None:
        counts["whole text (no cuts or no rules)"] += 1
        return
    bos = tokenizer.bos_token
    spliced = spliced_tokens(tokenizer, prompt, cuts, not (bos and prompt.startswith(bos)))
    counts["spliced" if spliced is not None else "fell back with cuts"] += 1


#: Pieces of the dense fuzzer's text around and inside documents (with `FRAGMENTS`): literal
#: ``▁`` and ``Ġ``, compatibility characters whose NFKC holds spaces or letters, brackets,
#: control characters and spaces that Python and the tokenizers' regexes class differently.
PIECES = [*FRAGMENTS, "▁", "Ġ", "\u0345", "\u0f73", "ﾞ", "ｶﾞ", "㏂", "\ufdfa", "´", "ǅ", "<", ">",
          "|", "[", "]", "/", ",", "\r\n\r\n", " '", "' ", "\x0b", "\x0c", "\x1c", "\x85",
          "\u2029", "\u3000", "\u1680"]  # fmt: skip
WORDS = ["the", "a", "word", "It", "s", "don", "t", "ab", "Xy", "ship", "lighthouse", "x", "I"]


def _junk(rng: random.Random, pieces: list[str], most: int) -> str:
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, most)))


def dense_document(rng: random.Random) -> str:
    """A short document: runs of words (with cuts) between junk, junk next to a cut."""
    parts = [_junk(rng, PIECES, 6)]
    for _ in range(rng.randint(1, 3)):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 25)))
        if rng.random() < 0.5:
            at = _near_cut(rng, words)
            words = words[:at] + _junk(rng, PIECES, 3) + words[at:]
        parts += [words, _junk(rng, PIECES, 4)]
    return "".join(parts)


def dense_fuzz(tokenizer: Any, prompts: int, seed: int) -> Counter[str]:
    """Short prompts dense in adversarial text, checked on `prompt_tokens` directly.

    Documents are laid out behind an empty context, a plain one, junk or a BOS; the prompt is
    junk and special tokens' text around 1-4 documents. Ids and offsets must equal the whole
    text's; ``counts`` tallies prompts spliced and fallen back with cuts.
    """
    rng = random.Random(seed)
    pieces = PIECES + special_texts(tokenizer)
    bos = tokenizer.bos_token
    contexts = ["", "Documents:\n\n", _junk(rng, pieces, 8)] + ([bos + "Docs:\n"] if bos else [])
    counts: Counter[str] = Counter()
    for _ in range(prompts):
        context = rng.choice(contexts)
        text = (bos if bos and rng.random() < 0.2 else "") + _junk(rng, pieces, 5)
        spans = []
        for _ in range(rng.randint(1, 4)):
            document = dense_document(rng)
            spans.append((len(text), len(text) + len(document)))
            text += document + _junk(rng, pieces, 5)
        layouts = {span: document_layout(tokenizer, context, text[span[0] : span[1]])
                   for span in spans}  # fmt: skip
        tokens, whole = prompt_tokens(tokenizer, text, layouts), encode_prompt(tokenizer, text)
        assert tokens.ids.tolist() == whole.ids.tolist(), (context, text, spans)
        assert tokens.offsets.tolist() == whole.offsets.tolist(), (context, text, spans)
        cuts = [(start, layout.cut, layout.tokens.ids, layout.tokens.offsets)
                for (start, _), layout in layouts.items() if layout.cut is not None]  # fmt: skip
        counts["prompts"] += 1
        if cuts and splice_rules(tokenizer) is not None:
            adds = not (bos and text.startswith(bos))
            spliced = spliced_tokens(tokenizer, text, cuts, adds) is not None
            counts["spliced" if spliced else "fell back with cuts"] += 1
    return counts


def fuzz_engine(tokenizer: Any, doc_prefix: str | None) -> BlendEngine:
    """An engine over ``tokenizer`` and a tiny random Llama (planning never runs the model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvblend.store import MemoryKVStore

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1 << 17,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return BlendEngine(
        model, tokenizer, store=MemoryKVStore(), system_prompt=SYSTEM, doc_prefix=doc_prefix,
        check_parity=False,
    )  # fmt: skip


def fuzz(tokenizer: Any, prompts: int, seed: int, passages: list[tuple[str, str]]) -> Counter[str]:
    """Check ``prompts`` random prompts on engines whose documents follow a chat head or BOS."""
    rng = random.Random(seed)
    engines = [fuzz_engine(tokenizer, "auto"), fuzz_engine(tokenizer, None)]
    documents = make_documents(rng, passages, tokenizer, 3 * len(passages))
    for engine in engines:
        engine.register([text for _, text in documents])
    specials = special_texts(tokenizer)
    counts: Counter[str] = Counter()
    for index in range(prompts):
        prompt, shape = build_prompt(rng, tokenizer, documents, specials)
        counts[f"shape {shape}"] += 1
        check_prompt(engines[index % 2], prompt, counts)
    return counts


def main() -> None:
    """``python tests/prompt/splice_fuzz.py``: a larger run than the suite's, a line a tokenizer."""
    import argparse
    import tempfile
    import time

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=400, help="RAG prompts per tokenizer")
    parser.add_argument("--dense", type=int, default=2000, help="dense prompts per tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nq", help="NQ jsonl(.gz) whose passages are the documents")
    parser.add_argument("--passages", type=int, default=60, help="passages read from --nq")
    parser.add_argument("--qwen", help="a Qwen2.5 GGUF file (scripts/bench_models.py qwen2.5-0.5b)")
    parser.add_argument("--only", help="comma list of tokenizer names")
    args = parser.parse_args()
    passages = load_passages(args.nq, args.passages, random.Random(args.seed))
    with tempfile.TemporaryDirectory() as folder:
        from fuzz_tokenizers import tokenizers

        for name, factory in tokenizers(Path(folder), args.qwen).items():
            if args.only and name not in args.only.split(","):
                continue
            started = time.perf_counter()
            tokenizer = factory()
            rules = "rules" if splice_rules(tokenizer) is not None else "no rules"
            counts = fuzz(tokenizer, args.prompts, args.seed, passages)
            dense = dense_fuzz(tokenizer, args.dense, args.seed)
            counts.update({f"dense {key}": value for key, value in dense.items()})
            seconds = time.perf_counter() - started
            shown = ", ".join(f"{key}: {value}" for key, value in sorted(counts.items()))
            print(f"{name} ({rules}, {seconds:.0f} s): {shown}", flush=True)


if __name__ == "__main__":
    import sys

    sys.path[:0] = [
        str(Path(__file__).parent),
        str(Path(__file__).parents[1]),
        str(Path(__file__).parents[2] / "src"),
    ]
    main()
