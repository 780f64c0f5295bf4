"""Prompt fidelity: the model reads exactly the token ids its tokenizer gives the whole prompt.

Checked for every tokenizer family kvblend supports, against transformers itself:

- GPT-2-style byte-level BPE: the bundled SmolLM2 tokenizer (real files);
- SentencePiece: Mistral's v1 (Mistral-7B v0.1, the Llama-2 style) and v3 tokenizers, the real
  files from the `mistral-common` package;
- Qwen2 and Llama-3 byte-level BPE: tokenizers with those families' pre-tokenizer rules (and
  Llama-3's BOS), trained here on a small corpus;
- the byte tokenizer of the other exactness tests.

For each: the prompt's token ids equal ``tokenizer(prompt)`` (or ``apply_chat_template``), greedy
``BlendConfig("full")`` output equals ``model.generate``, documents following a space or a
newline are found and reused, and with each document's cached KV taken from its real context
every strategy reproduces full prefill (which proves the cached rows land on the right tokens).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from conftest import TINY, byte_tokenizer, smollm2_tokenizer
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend.prefill import run_blend
from kvblend.blend.types import COMPUTE, BlendInput
from kvblend.store import MemoryKVStore

DOCS = [
    "The lighthouse at Brno is painted red and white.",
    "Copperleaf was founded by Ada Moss in 1999; très calme, she said.",
    "Room 12 hosts the 9:30 meeting\nevery Tuesday.",
]
# Shapes of real prompts: documents after a space, after newlines, at the very start, glued to
# the text after them, and inside a chat template.
PROMPTS = {
    "after-space": f"Context: {DOCS[0]}\n\n{DOCS[1]}\nQuestion: who founded Copperleaf?\nAnswer:",
    "numbered": f"Document [1] {DOCS[2]}\nDocument [2] {DOCS[0]}\n\nQ: where?\nA:",
    "at-start": f"{DOCS[1]}\n\n{DOCS[2]}\n\nWhen is the meeting?",
    "glued": f"Docs:{DOCS[0]}{DOCS[2]}Answer in one word:",
}
STRATEGIES = [
    BlendConfig("reuse"),
    BlendConfig("cacheblend", recompute_ratio=0.3),
    BlendConfig(
        "attention",
        recompute_ratio=0.3,
        lead_tokens=2,
        short_document=0,
        min_recompute=0,
        full_above=1.0,
        per_document=0,
    ),
    BlendConfig("epic", epic_tokens=2),
]

# Pre-tokenizer rules of the Qwen2 and Llama-3 tokenizers (their tokenizer.json "Split" regex).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] }}"
    "{% endif %}{% endfor %}"
)


def trained_bpe(split: str, bos: str | None) -> PreTrainedTokenizerFast:
    """A byte-level BPE with a family's pre-tokenizer rules, trained on a small corpus."""
    specials = ["<pad>", "</s>"] + ([bos] if bos else [])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [*DOCS, *PROMPTS.values()] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token="</s>", pad_token="<pad>"
    )


def mistral_tokenizer(file_name: str, folder: Path) -> PreTrainedTokenizerFast:
    """Mistral's SentencePiece tokenizer file, loaded by transformers as Mistral ships it."""
    import mistral_common

    source = Path(mistral_common.__file__).parent / "data" / file_name
    if not source.is_file():
        pytest.fail(f"mistral-common no longer ships {file_name}")
    folder.mkdir()
    shutil.copy(source, folder / "tokenizer.model")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), add_bos_token=True)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


FAMILIES = ["byte", "smollm2", "mistral-v1", "mistral-v3", "qwen2-bpe", "llama3-bpe"]


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> BlendEngine:
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    if family == "byte":
        tokenizer = byte_tokenizer()
    elif family == "smollm2":
        tokenizer = smollm2_tokenizer()
    elif family == "mistral-v1":
        tokenizer = mistral_tokenizer("tokenizer.model.v1", folder / "tok")
    elif family == "mistral-v3":
        tokenizer = mistral_tokenizer("mistral_instruct_tokenizer_240323.model.v3", folder / "tok")
    elif family == "qwen2-bpe":
        tokenizer = trained_bpe(QWEN2_SPLIT, bos=None)
    else:
        tokenizer = trained_bpe(LLAMA3_SPLIT, bos="<|begin_of_text|>")
    config = {
        **TINY,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(0)
    model = (
        Qwen2ForCausalLM(Qwen2Config(**config))
        if family == "qwen2-bpe"
        else LlamaForCausalLM(LlamaConfig(**config))
    ).eval()
    return BlendEngine(model, tokenizer, store=MemoryKVStore(), name=family)


def expected_ids(engine: BlendEngine, prompt: str) -> list[int]:
    return list(engine.tokenizer(prompt)["input_ids"])


def reference_tokens(engine: BlendEngine, prompt: str, max_new_tokens: int) -> list[int]:
    """New token ids of transformers' own greedy `generate` on the prompt text."""
    ids = torch.tensor([expected_ids(engine, prompt)])
    with torch.inference_mode():
        output = engine.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=engine.tokenizer.pad_token_id,
            eos_token_id=engine.tokenizer.eos_token_id,
        )  # fmt: skip
    return list(output[0, ids.shape[1] :].tolist())


@pytest.mark.parametrize("shape", sorted(PROMPTS))
def test_prompt_ids_equal_the_tokenizer_on_the_whole_text(engine: BlendEngine, shape: str) -> None:
    engine.precompute(DOCS, progress=False)
    prompt = PROMPTS[shape]
    pre = engine.prefill(prompt, BlendConfig("reuse"))
    assert pre.token_ids == expected_ids(engine, prompt)
    explicit = engine.prefill(engine.segments_for(prompt), BlendConfig("full"))
    assert explicit.token_ids == expected_ids(engine, prompt)


@pytest.mark.parametrize("shape", sorted(PROMPTS))
def test_documents_are_found_and_reused_in_every_shape(engine: BlendEngine, shape: str) -> None:
    engine.precompute(DOCS, progress=False)
    prompt = PROMPTS[shape]
    stats = engine.prefill(prompt, BlendConfig("reuse")).stats
    assert stats.documents_found == 2 and stats.documents_reused == 2, stats
    interior = sum(len(engine.tokenize(d)) for d in DOCS if d in prompt) - 2 * 2  # edges
    assert stats.reused_tokens >= interior, stats
    assert stats.segments_precomputed == 0


def test_full_greedy_output_equals_model_generate_on_the_text(engine: BlendEngine) -> None:
    engine.precompute(DOCS, progress=False)
    prompt = PROMPTS["after-space"]
    out = engine.generate(prompt, BlendConfig("full"), max_new_tokens=10)
    assert out.token_ids == reference_tokens(engine, prompt, 10)


def test_chat_template_prompt_equals_apply_chat_template(engine: BlendEngine) -> None:
    """A chat-rendered prompt (BOS written by the template) gets no second BOS."""
    if engine.tokenizer.chat_template is None:
        pytest.skip("this tokenizer has no chat template")  # the byte and trained ones
    messages = [{"role": "user", "content": f"Docs: {DOCS[0]}\n\nWhere is the lighthouse?"}]
    text = engine.apply_chat_template(messages)
    reference = engine.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert engine.encode(text) == list(reference)
    engine.precompute(DOCS[:1], progress=False)
    assert engine.prefill(text, BlendConfig("reuse")).stats.documents_reused == 1


def plant_in_context_kv(engine: BlendEngine, prompt: str) -> None:
    """Store, for each planned document span, the KV its rows have in this very prompt."""
    plan = engine.plan(prompt)
    full = run_blend(
        engine.decoder,
        BlendInput(
            torch.tensor(plan.token_ids),
            torch.full((len(plan.token_ids),), COMPUTE, dtype=torch.int8),
            [],
        ),
        BlendConfig("full").selector(),
        need_logits=False,
    )
    assert full.raw_kv is not None
    for span in plan.spans:
        from kvblend.prompt.segments import segment_key

        key = segment_key(engine.fingerprint, span.context_ids, span.cached_ids)
        rows = slice(span.cached_start, span.cached_start + span.end - span.start)
        layers, _, heads, _, head_dim = full.raw_kv.shape
        stored = torch.zeros(layers, 2, heads, len(span.cached_ids), head_dim)
        stored[:, :, :, rows] = full.raw_kv[:, :, :, span.start : span.end]
        engine.store.put(key, {"kv": stored})


@pytest.mark.parametrize("config", STRATEGIES, ids=lambda c: c.strategy)
@pytest.mark.parametrize("shape", ["after-space", "glued"])
def test_in_context_kv_makes_every_strategy_exact(
    engine: BlendEngine, config: BlendConfig, shape: str
) -> None:
    """Cached rows land on exactly the prompt tokens they belong to (for every tokenizer)."""
    prompt = PROMPTS[shape]
    engine.register(DOCS)
    reference = engine.prefill(prompt, BlendConfig("full"))
    plant_in_context_kv(engine, prompt)
    pre = engine.prefill(prompt, config)
    assert pre.stats.documents_reused == 2 and pre.stats.reused_tokens > 0
    error = (pre.logits - reference.logits).abs().max()
    assert error < 1e-4, f"max abs logit error {error:.3g}"
    engine.store.clear()  # planted entries must not leak into other tests


def test_a_document_after_its_precompute_head_is_reused_exactly(engine: BlendEngine) -> None:
    engine.precompute(DOCS, progress=False)
    segments = engine.rag_segments("Who founded Copperleaf?", [DOCS[1], DOCS[0]])
    text = "".join(segment.text for segment in segments)
    pre = engine.prefill(segments, BlendConfig("reuse"))
    assert pre.token_ids == engine.encode(text)
    first = engine.explain(segments).plan.report[1]
    assert first.exact and first.reused > 0
    only_first = [segments[0], segments[1], Segment(segments[-1].text, cache=False)]
    exact = engine.prefill(only_first, BlendConfig("reuse"))
    full = engine.prefill(only_first, BlendConfig("full"))
    assert exact.stats.moved_tokens == 0
    assert (exact.logits - full.logits).abs().max() < 1e-4


def test_full_through_the_adapters_equals_model_generate(engine: BlendEngine) -> None:
    """The LangChain and LlamaIndex adapters feed the model the prompt text they were given."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from kvblend.langchain import BlendLLM as LangChainLLM
    from kvblend.llamaindex import BlendLLM as LlamaIndexLLM

    engine.precompute(DOCS, progress=False)
    prompt = PROMPTS["numbered"]
    reference = reference_tokens(engine, prompt, 8)
    expected = engine.tokenizer.decode(reference, skip_special_tokens=True)
    full = BlendConfig("full")
    langchain = LangChainLLM(engine=engine, blend_config=full, chat_template=False, max_tokens=8)
    assert langchain.invoke(prompt) == expected
    llamaindex = LlamaIndexLLM(engine=engine, blend_config=full, max_tokens=8)
    assert llamaindex.complete(prompt, formatted=True).text == expected
