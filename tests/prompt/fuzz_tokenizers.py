"""Tokenizers for fuzzing spliced prompt tokens: every one available offline, and trained ones.

Real files: the bundled SmolLM2's, Mistral's SentencePiece v1 (also loaded non-legacy and with
an EOS added), v2, v3, v7 and tekken files of mistral-common, and a Qwen2.5 GGUF's when given.
Trained here (byte-level BPE over a small corpus): GPT-2's rule (with and without a prefix
space), Qwen2's rule with NFC (as Qwen2.5 ships it), Llama-3's with NFKC, NFKD and a prefix
space; and tekken's 131K-token vocabulary under Llama-3's and GPT-2's rules.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def trained(split: str | None, normalizer: Any = None, prefix_space: bool = False) -> Any:
    """A byte-level BPE trained here: GPT-2's rule (``split=None``) or a Split rule's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=split is None)
    tokenizer.pre_tokenizer = (
        byte_level
        if split is None
        else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=True)
    specials = ["<pad>", "</s>", "<|im_start|>", "<|im_end|>"]
    from splice_fuzz import FRAGMENTS, PASSAGES

    corpus = [text for _, text in PASSAGES] * 10 + FRAGMENTS * 5
    trainer = trainers.BpeTrainer(
        vocab_size=1200, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHATML
    return fast


def with_added_phrases(tokenizer: Any) -> Any:
    """``tokenizer`` with added tokens of words and spaces, and ones stripping or whole-word.

    Their text (``of the``, ``a log``, a bare ``the``, two spaces) is common in documents, so
    their documents have no cuts or cuts around them; ``<sep>`` eats the spaces around it.
    """
    from tokenizers import AddedToken

    tokenizer.add_tokens(
        [
            AddedToken("of the", normalized=False),
            AddedToken("a log", normalized=False),
            AddedToken("the", single_word=True, normalized=False),
            AddedToken("  ", normalized=False),
            AddedToken("<sep>", lstrip=True, rstrip=True, normalized=False),
        ]
    )
    return tokenizer


def mistral_file(file_name: str, folder: Path, **options: Any) -> Any:
    """A SentencePiece file of mistral-common loaded by transformers (as test_fidelity does)."""
    import mistral_common
    from transformers import AutoTokenizer

    from test_fidelity import MISTRAL_TEMPLATE

    folder.mkdir(parents=True, exist_ok=True)
    data = Path(mistral_common.__file__).parent / "data"
    shutil.copy(data / file_name, folder / "tokenizer.model")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), add_bos_token=True, **options)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


@functools.cache
def tekken(file_name: str) -> Any:
    """A tekken (tiktoken-style) tokenizer of mistral-common, converted by transformers."""
    import mistral_common
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    return convert_tekken_tokenizer(str(Path(mistral_common.__file__).parent / "data" / file_name))


def tekken_vocabulary(split: str | None) -> Any:
    """Tekken's 131K-token vocabulary and merges (``ignore_merges``, as Llama-3's) under
    Llama-3's pre-tokenizer rule (or GPT-2's, ``split=None``) and Llama-3's BOS: a real
    vocabulary under each byte-level rule the splice accepts."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(tekken("tekken_240911.json").backend_tokenizer.to_str())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    backend.pre_tokenizer = (
        byte_level
        if split is None
        else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHATML.replace("<|im_start|>", "[INST]").replace("<|im_end|>", "[/INST]")
    return fast


def qwen_gguf(path: str, nfc: bool = False) -> Any:
    """The tokenizer of a Qwen2.5 GGUF file (``nfc``: with the NFC normalizer Qwen ships)."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    file = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    if nfc:
        tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def tokenizers(folder: Path, qwen: str | None = None) -> dict[str, Any]:
    """Factories of every tokenizer the fuzzer knows (real files first, then trained ones)."""
    from tokenizers import normalizers

    from conftest import byte_tokenizer
    from test_fidelity import LLAMA3_SPLIT, QWEN2_SPLIT, smollm2_tokenizer

    found: dict[str, Any] = {
        "smollm2": smollm2_tokenizer,
        "mistral-v1": lambda: mistral_file("tokenizer.model.v1", folder / "v1"),
        "mistral-v1-nonlegacy": lambda: mistral_file(
            "tokenizer.model.v1", folder / "v1n", legacy=False
        ),
        "mistral-v1-eos": lambda: mistral_file(
            "tokenizer.model.v1", folder / "v1e", add_eos_token=True
        ),
        "mistral-v2": lambda: mistral_file(
            "mistral_instruct_tokenizer_240216.model.v2", folder / "v2"
        ),
        "mistral-v3": lambda: mistral_file(
            "mistral_instruct_tokenizer_240323.model.v3", folder / "v3"
        ),
        "mistral-v7": lambda: mistral_file(
            "mistral_instruct_tokenizer_241114.model.v7", folder / "v7"
        ),
        "tekken-240718": lambda: tekken("tekken_240718.json"),
        "tekken-240911": lambda: tekken("tekken_240911.json"),
        "tekken-vocabulary-llama3-rule": lambda: tekken_vocabulary(LLAMA3_SPLIT),
        "tekken-vocabulary-gpt2-rule": lambda: tekken_vocabulary(None),
        "byte": byte_tokenizer,
        "gpt2-bpe": lambda: trained(None),
        "gpt2-bpe-prefix-space": lambda: trained(None, prefix_space=True),
        "qwen2-bpe": lambda: trained(QWEN2_SPLIT),
        "qwen2-bpe-nfc": lambda: trained(QWEN2_SPLIT, normalizers.NFC()),
        "qwen2-bpe-added-phrases": lambda: with_added_phrases(trained(QWEN2_SPLIT)),
        "mistral-v3-added-phrases": lambda: with_added_phrases(
            mistral_file("mistral_instruct_tokenizer_240323.model.v3", folder / "v3p")
        ),
        "llama3-bpe-nfkc": lambda: trained(LLAMA3_SPLIT, normalizers.NFKC()),
        "llama3-bpe-nfkd-prefix-space": lambda: trained(
            LLAMA3_SPLIT, normalizers.NFKD(), prefix_space=True
        ),
    }
    if qwen:
        found["qwen2.5-gguf"] = lambda: qwen_gguf(qwen)
        found["qwen2.5-gguf-nfc"] = lambda: qwen_gguf(qwen, nfc=True)
    return found
