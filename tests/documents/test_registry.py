"""The document registry: exact matching in prompts, bounds, and sharing through the store."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.documents.registry import DocumentRegistry, Match
from kvblend.documents.registry_records import DOCUMENT, HEAD_CHARS, anchor_hash, text_digest
from kvblend.store import DiskKVStore, MemoryKVStore, default_store

A = "Marta Quill is a beekeeper who lives in Lisbon."
B = "Tomas Elm is a violin maker who lives in Cremona."
C = "Marta Quill is a beekeeper"  # a prefix of A


def spans(prompt: str, matches: list[Match]) -> list[str]:
    return [prompt[m.start : m.end] for m in matches]


def test_finds_every_known_document_longest_first_without_overlap() -> None:
    registry = DocumentRegistry(MemoryKVStore(), "documents-test")
    registry.add([A, B, C])
    prompt = f"Context: {B}\n\n{A}\nAnd again: {A} Q: {C}?"
    assert spans(prompt, registry.find(prompt)) == [B, A, A, C]
    assert registry.find("nothing known here at all") == []
    assert A in registry and "unknown text here" not in registry


def test_short_documents_are_not_registered() -> None:
    registry = DocumentRegistry(MemoryKVStore(), "documents-test")
    registry.add(["short", "eight ch"])
    assert "short" not in registry and "eight ch" in registry
    assert spans("x eight ch y", registry.find("x eight ch y")) == ["eight ch"]


def test_least_recently_matched_documents_are_dropped_past_capacity() -> None:
    registry = DocumentRegistry(MemoryKVStore(), "documents-test", capacity=2)
    registry.add([A, B])
    registry.find(f"{A}")  # A is now the most recently used
    registry.add(["A third document, long enough."])
    assert A in registry and B not in registry and len(registry) == 2


def test_finds_follow_documents_added_and_dropped_between_searches() -> None:
    import random

    from kvblend.documents.anchors import non_overlapping

    rng = random.Random(7)
    words = ["hive", "violin", "Lisbon", "river", "lamp", "quill", "harbour", "saffron"]
    texts = [" ".join(rng.choices(words, k=rng.randint(2, 9))) + f" #{n}." for n in range(40)]
    texts += [text[: len(text) // 2 + 4] for text in texts[:10]]  # prefixes: shared anchors
    registry = DocumentRegistry(MemoryKVStore(), "documents-test", capacity=12)
    for step in range(60):
        if step % 3:  # two searches in a row: the second one uses the sorted anchor arrays
            registry.add(rng.sample(texts, rng.randint(1, 4)))  # past capacity: some dropped
        prompt = " | ".join(rng.sample(texts, 8))
        known = [text for text in set(texts) if text in registry]
        expected = non_overlapping(
            [
                (start, start + len(text), b"")
                for text in known
                for start in range(len(prompt))
                if prompt.startswith(text, start)
            ]
        )
        assert [(m.start, m.end) for m in registry.find(prompt)] == expected, step
        assert [(m.start, m.end) for m in registry.find(prompt)] == expected, step


def test_a_document_added_is_found_though_the_newest_document_is_unchanged() -> None:
    registry = DocumentRegistry(MemoryKVStore(), "documents-test", capacity=2)
    third = "A third document, long enough."
    registry.add([A, B])
    assert spans(A, registry.find(A)) == spans(A, registry.find(A)) == [A]
    registry.add([third])  # B dropped: as many documents as before
    registry.add([A])  # already known: A is again the newest, as at the last search
    assert spans(f"{third} {A}", registry.find(f"{third} {A}")) == [third, A]
    assert registry.find(B) == []


def test_a_near_miss_is_the_first_known_start_outside_the_matches() -> None:
    registry = DocumentRegistry(MemoryKVStore(), "documents-test")
    assert registry.anchor_in(f"x {A}") is None
    registry.add([A, B])
    prompt = f"{A[:40]} and {B} and {A[:34]}"
    matches = [(m.start, m.end) for m in registry.find(prompt)]
    assert registry.anchor_in(prompt, matches) == (0, len(A))
    assert registry.anchor_in(prompt[30:], [(m - 30, n - 30) for m, n in matches]) == (
        len(prompt) - 34 - 30,
        len(A),
    )


def test_registries_over_one_folder_share_documents(tmp_path: Path) -> None:
    writer = DocumentRegistry(DiskKVStore(tmp_path), "documents-test")
    reader = DocumentRegistry(DiskKVStore(tmp_path), "documents-test")
    other_model = DocumentRegistry(DiskKVStore(tmp_path), "documents-other")
    writer.add([A])
    assert spans(A, reader.find(A)) == [A]
    writer.add([B])  # read incrementally on the next search
    assert spans(f"{B} {A}", reader.find(f"{B} {A}")) == [B, A]
    assert other_model.find(A) == []
    # Records hold hashes, never the text.
    blob = b"".join(path.read_bytes() for path in tmp_path.rglob("*") if path.is_file())
    assert b"beekeeper" not in blob and "beekeeper".encode("utf-16-le") not in blob


def test_a_broken_shared_log_leaves_the_local_registry_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(MemoryKVStore):
        def append_records(self, log, records):
            raise OSError("disk gone")

        def read_records(self, log, cursor=0):
            raise OSError("disk gone")

    registry = DocumentRegistry(Broken(), "documents-test")
    with caplog.at_level(logging.WARNING):
        registry.add([A])
        assert spans(A, registry.find(A)) == [A]
    assert "disk gone" in caplog.text


def test_engine_warns_when_a_prompt_holds_no_known_document(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute([A])
    with caplog.at_level(logging.WARNING, logger="kvblend.engine.engine"):
        engine.prefill(f"{A.strip('.')}, trimmed.\nQ?", BlendConfig("reuse"))
        engine.prefill("another prompt without it\nQ?", BlendConfig("reuse"))
    warnings = [r for r in caplog.records if "no precomputed document" in r.message]
    assert len(warnings) == 1  # rate limited
    assert "exact text" in warnings[0].message and "explain" in warnings[0].message
    stats = engine.prefill(f"Docs: {A}\nQ?", BlendConfig("reuse")).stats
    assert (stats.documents_found, stats.documents_reused) == (1, 1)


def test_explain_says_what_is_reused_and_why() -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute([A])
    engine.register([B])  # known, not computed yet
    explanation = engine.explain(f"Context: {A}\n\n{B}\nQuestion: where?")
    text = str(explanation)
    assert explanation.documents_found == 2
    # two short documents: recomputed whole, and said so (not "reused at its new position"
    # beside "0 reused")
    assert "0 reused, " in text and "recomputed whole (min_recompute)" in text
    assert "reused at its new position" not in text
    assert "not in the store yet" in text
    assert "'\\nQuestion: where?': computed" in text
    assert not engine.store.contains(engine.segment_id(B))  # explain computes nothing


WORKER = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from conftest import byte_tokenizer, tiny_model
    from kvblend import BlendConfig, BlendEngine
    from kvblend.store import default_store

    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=default_store({folder!r}))
    if sys.argv[1] == "precompute":
        engine.precompute(json.loads(sys.argv[2]))
    else:
        stats = engine.prefill(sys.argv[2], BlendConfig("reuse")).stats
        print(json.dumps([stats.documents_reused, stats.reused_tokens,
                          stats.segments_precomputed]))
    """
)


@pytest.mark.slow
def test_a_second_process_reuses_documents_it_never_precomputed(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(
        WORKER.format(tests=str(Path(__file__).parents[1]), folder=str(tmp_path / "store"))
    )
    import json

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    run("precompute", json.dumps([A, B]))
    reused, tokens, precomputed = json.loads(run("ask", f"Docs: {B}\n\n{A}\nWho keeps bees?"))
    assert reused == 2 and tokens > 0 and precomputed == 0
    # ... and the same holds for a new engine in this process (a restart).
    engine = BlendEngine(
        tiny_model("qwen2"), byte_tokenizer(), store=default_store(tmp_path / "store")
    )
    assert engine.is_known(A) and len(engine.library.registry) == 2


FOLDER_WORKER = textwrap.dedent(
    """
    import json, sys
    from kvblend import BlendConfig, BlendEngine
    from kvblend.store import default_store

    engine = BlendEngine.from_pretrained(sys.argv[1], store=default_store({folder!r}),
                                         device="cpu", system_prompt=sys.argv[2])
    if sys.argv[3] == "precompute":
        engine.precompute(json.loads(sys.argv[4]))
    else:
        stats = engine.prefill(sys.argv[4], BlendConfig("reuse")).stats
        print(json.dumps([engine.fingerprint, stats.documents_reused, stats.reused_tokens,
                          stats.segments_precomputed]))
    """
)


def _run_worker(script: Path, cache_home: Path, *args: str) -> str:
    import os

    env = dict(os.environ, KVBLEND_CACHE_DIR=str(cache_home), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_same_model_from_two_folders_shares_one_store(tmp_path: Path) -> None:
    import json

    model, tokenizer = tiny_model("qwen2"), byte_tokenizer()
    folders = [tmp_path / "alice" / "cache" / "model", tmp_path / "bob" / "models" / "tiny"]
    for folder in folders:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    script = tmp_path / "worker.py"
    script.write_text(FOLDER_WORKER.format(folder=str(tmp_path / "store")))
    system = "Answer from the documents."
    _run_worker(script, tmp_path / "alice", str(folders[0]), system, "precompute", json.dumps([A]))
    prompt = f"Docs: {A}\nWho keeps bees?"
    fingerprint, reused, tokens, precomputed = json.loads(
        _run_worker(script, tmp_path / "bob", str(folders[1]), system, "ask", prompt)
    )
    assert (reused, precomputed) == (1, 0) and tokens > 0
    # a changed weight is another model: nothing of the first is read
    with __import__("torch").no_grad():
        model.get_parameter("model.norm.weight").view(-1)[0] += 1e-2
    model.save_pretrained(folders[1])
    other, reused, tokens, precomputed = json.loads(
        _run_worker(script, tmp_path / "bob", str(folders[1]), system, "ask", prompt)
    )
    assert other != fingerprint and (reused, tokens) == (0, 0)


REDIS_WORKER = textwrap.dedent(
    """
    import json, sys
    from kvblend import BlendConfig, BlendEngine
    from kvblend.store import default_store

    # each process has its own local tiers (under its cache home); only Redis is shared
    store = default_store(sys.argv[5], redis_url=sys.argv[6])
    engine = BlendEngine.from_pretrained(sys.argv[1], store=store, device="cpu",
                                         system_prompt=sys.argv[2])
    if sys.argv[3] == "precompute":
        engine.precompute(json.loads(sys.argv[4]))
    else:
        stats = engine.prefill(sys.argv[4], BlendConfig("reuse")).stats
        print(json.dumps([engine.fingerprint, stats.documents_found, stats.documents_reused,
                          stats.reused_tokens, stats.segments_precomputed]))
    """
)


@pytest.mark.slow
def test_the_same_model_from_two_cache_homes_shares_one_redis(tmp_path: Path, redis_server) -> None:
    import json

    model, tokenizer = tiny_model("qwen2"), byte_tokenizer()
    homes = [tmp_path / "alice", tmp_path / "bob"]
    folders = [homes[0] / "cache" / "model", homes[1] / "models" / "tiny"]
    for folder in folders:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    script = tmp_path / "worker.py"
    script.write_text(REDIS_WORKER)
    system, url = "Answer from the documents.", redis_server.url

    def run(home: Path, folder: Path, *args: str) -> str:
        return _run_worker(script, home, str(folder), system, *args, str(home / "kv"), url)

    run(homes[0], folders[0], "precompute", json.dumps([A, B]))
    assert not (homes[1] / "kv").exists()  # the second process starts with empty local tiers
    prompt = f"Docs: {B}\n\n{A}\nWho keeps bees?"
    fingerprint, found, reused, tokens, precomputed = json.loads(
        run(homes[1], folders[1], "ask", prompt)
    )
    assert (found, reused, precomputed) == (2, 2, 0) and tokens > 0
    with __import__("torch").no_grad():  # another model over the same server reads nothing
        model.get_parameter("model.norm.weight").view(-1)[0] += 1e-2
    model.save_pretrained(folders[1])
    other, found, reused, tokens, _ = json.loads(run(homes[1], folders[1], "ask", prompt))
    assert other != fingerprint and (found, reused, tokens) == (0, 0, 0)


def test_documents_are_found_whatever_head_they_were_precomputed_behind(tmp_path: Path) -> None:
    model = tiny_model("llama")
    first = BlendEngine(
        model, byte_tokenizer(), store=DiskKVStore(tmp_path), system_prompt="System X says hi."
    )
    first.precompute([A, B])
    second = BlendEngine(
        model, byte_tokenizer(), store=DiskKVStore(tmp_path), system_prompt="Y: another head."
    )
    assert first.doc_prefix != second.doc_prefix
    assert second.is_known(A) and second.is_known(B) and len(second.library.registry) == 2
    prompt = f"{second.doc_prefix}{A}\n\n{B}\nWho keeps bees?"
    stats = second.prefill(prompt, BlendConfig("reuse")).stats
    assert (stats.documents_found, stats.documents_reused) == (2, 2)
    assert stats.reused_tokens > 0 and stats.segments_precomputed == 0
    assert stats.moved_tokens > 0 and stats.prefix_tokens == 0  # another head: moved, not exact
    # the same prompt behind the first engine's head reuses its first document exactly
    exact = second.prefill(f"{first.doc_prefix}{A}\n\n{B}\nQ?", BlendConfig("reuse")).stats
    assert exact.prefix_tokens > 0 and exact.segments_precomputed == 0
    # explicit segments find the stored entries too, and full prefill reads nothing
    segments = second.rag_segments("Who keeps bees?", [A, B])
    listed = second.prefill(segments, BlendConfig("reuse")).stats
    assert listed.documents_reused == 2 and listed.segments_precomputed == 1  # only its head
    full = second.prefill(prompt, BlendConfig("full"))
    expected = model(__import__("torch").tensor([full.token_ids])).logits[0, -1]
    assert full.stats.reused_tokens == 0 and full.stats.computed_tokens == len(full.token_ids)
    assert (full.logits - expected).abs().max() < 1e-4
    # precomputing behind its own head adds an entry it then prefers
    second.precompute([A])
    assert second.library.registry.contexts(A) == [first.doc_prefix, second.doc_prefix]
    own = second.prefill(f"{second.doc_prefix}{A}\nQ?", BlendConfig("reuse")).stats
    assert own.prefix_tokens > 0


def test_a_long_context_is_recorded_in_parts(tmp_path: Path) -> None:
    long_head = "H" * 9000 + "é" * 10
    writer = DocumentRegistry(DiskKVStore(tmp_path), "documents-test")
    writer.add([A], context=long_head)
    writer.add([A, B], context="")
    reader = DocumentRegistry(DiskKVStore(tmp_path), "documents-test")
    assert reader.contexts(A) == [long_head, ""] and reader.contexts(B) == [""]


def test_a_question_naming_a_documents_first_words_is_no_near_miss() -> None:
    """Only a prompt holding a known document's first `HEAD_CHARS` characters holds a copy."""
    registry = DocumentRegistry(MemoryKVStore(), "documents-test")
    registry.add([A, B])
    question = "Marta Quill is a what, and where does she live?"
    assert A[:16] in question and registry.anchor_in(question) is None
    truncated = f"{B[:HEAD_CHARS]}\nQuestion: {question}"
    assert registry.anchor_in(truncated) == (0, len(B))
    # another process learns the heads from the log; one rebuilt from entries, from their metadata
    other = DocumentRegistry(registry.store, "documents-test")
    assert other.anchor_in(question) is None and other.anchor_in(truncated) == (0, len(B))


def test_a_document_known_without_its_head_is_checked_by_its_anchor() -> None:
    """Records written before heads existed: the anchor alone decides, as it did then."""
    store = MemoryKVStore()
    store.append_records("old", [DOCUMENT.pack(b"D", anchor_hash(A), len(A), text_digest(A),
                                               text_digest(""))])  # fmt: skip
    registry = DocumentRegistry(store, "old")
    assert registry.anchor_in("Marta Quill is a what, and where does she live?") == (0, len(A))
