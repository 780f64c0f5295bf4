"""``kvblend precompute`` and ``ask`` over folders: files that fit are stored, every other file is
named (hidden ones skipped), sizes are checked before tokenizing, mistakes are refused before the
model loads; no torch for ``--help``, and each command's help lists only the options it uses."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.blend.selectors import strategy_names
from kvblend.cli.args import DEFAULT_CORRECTION, DEFAULT_RATIO, STRATEGIES
from kvblend.cli.main import main
from kvblend.cli.precompute import (
    DocumentFiles,
    document_room,
    fitting_documents,
    list_files,
    precompute_each,
    read_files,
)
from kvblend.store import MemoryKVStore
from kvblend.validation import tokens_beyond


@pytest.fixture
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


@pytest.fixture
def loaded(engine: BlendEngine, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The CLI's model loads give the tiny engine; the list records each load's keywords."""
    loads: list[dict] = []

    def from_pretrained(cls, model=None, **kwargs):  # noqa: ANN001, ANN202
        loads.append(kwargs)
        return engine

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    return loads


def _spy_tokenize(engine: BlendEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the length of every text ``engine.tokenize`` is given."""
    seen: list[int] = []
    tokenize = engine.tokenize

    def spy(text: str) -> list[int]:
        seen.append(len(text))
        return tokenize(text)

    monkeypatch.setattr(engine, "tokenize", spy)
    return seen


def test_a_file_too_long_is_named_and_skipped_and_the_others_stored(
    engine: BlendEngine, caplog: pytest.LogCaptureFixture
) -> None:
    room = document_room(engine)
    named = [("a.txt", "Marta lives in Lisbon."), ("big.txt", "word " * room),
             ("b.txt", "Tomas lives in Cremona.")]  # fmt: skip
    files = DocumentFiles()
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        documents = fitting_documents(engine, named, chunk=False, files=files)
        stored = precompute_each(engine, documents, files)
    assert [name for name, _ in documents] == ["a.txt", "b.txt"] and stored == 2
    assert [r.getMessage() for r in caplog.records if "big.txt" in r.getMessage()] == [
        f"skipping big.txt: more than {room} tokens, longer than {engine.name}'s context "
        f"window leaves a document ({room}); --chunk splits it"
    ]
    assert files.skipped == ["big.txt"]
    assert engine.is_known("Marta lives in Lisbon.")


def test_a_text_over_the_window_is_refused_without_tokenizing_all_of_it(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = engine.library.window
    text = "word " * (window.tokens * window.max_token_chars // 5 - 1)  # under the character cap
    assert len(text) <= window.tokens * window.max_token_chars
    seen = _spy_tokenize(engine, monkeypatch)
    assert fitting_documents(engine, [("long.txt", text)], chunk=False) == []
    assert seen and max(seen) < len(text)  # a prefix of about 4 characters a token, not all
    # the API's own check refuses it the same way
    seen.clear()
    with pytest.raises(ValueError, match="of at least [0-9,]+ tokens is longer"):
        engine.precompute([text])


def _fidelity_helpers() -> ModuleType:
    """tests/prompt/test_fidelity.py's tokenizer builders, loaded by path (that folder is on
    ``sys.path`` only when one of its tests is collected)."""
    path = Path(__file__).parents[1] / "prompt" / "test_fidelity.py"
    spec = importlib.util.spec_from_file_location("kvblend_tests_fidelity", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["byte", "mistral-v1", "smollm2"])
def test_the_prefix_bound_never_exceeds_the_whole_count(kind: str, tmp_path: Path) -> None:
    fidelity = _fidelity_helpers()
    mistral_tokenizer, smollm2_tokenizer = fidelity.mistral_tokenizer, fidelity.smollm2_tokenizer
    tokenizer = {
        "byte": lambda: byte_tokenizer(),
        "mistral-v1": lambda: mistral_tokenizer("tokenizer.model.v1", tmp_path / "tok"),
        "smollm2": smollm2_tokenizer,
    }[kind]()

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    texts = [
        "Marta Quill keeps bees in Lisbon. " * 300,
        "antidisestablishmentarianism " * 200 + "x" * 3000,
        "\n\n".join(f"Paragraph {i}:  words,   spaced\tand tabbed." for i in range(400)),
        "日本語のテキスト、句読点つき。" * 200 + " end",
        "short",
    ]
    for text in texts:
        whole = len(tokenize(text))
        for limit in (10, 100, whole - 1, whole, 5000):
            found = tokens_beyond(tokenize, text, limit)
            if whole <= limit:
                assert found is None, (kind, text[:20], limit)
            elif found is not None:
                tokens, exact = found
                assert limit < tokens <= whole and (tokens == whole or not exact)
            else:
                pytest.fail(f"{kind}: {whole} tokens > {limit} not found")


def test_chunk_splits_a_long_file_into_documents_that_fit(engine: BlendEngine) -> None:
    room = document_room(engine)
    text = " ".join(f"w{i}" for i in range(room))  # about 4 x room tokens
    documents = fitting_documents(engine, [("big.txt", text)], chunk=True)
    assert len(documents) >= 3
    assert all(len(engine.tokenize(piece)) <= room for _, piece in documents)
    assert precompute_each(engine, documents) == len(documents)
    assert " ".join(piece for _, piece in documents).split() == text.split()


def test_one_refused_document_does_not_cost_the_batch(
    engine: BlendEngine, caplog: pytest.LogCaptureFixture
) -> None:
    bad = "Lone surrogate \udcff here."
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        stored = precompute_each(engine, [("a.txt", "Marta lives in Lisbon."), ("bad.txt", bad)])
    assert stored == 1 and "skipping bad.txt" in caplog.text


def _folder(tmp_path: Path) -> Path:
    docs = tmp_path / "docs"
    (docs / ".git").mkdir(parents=True)
    (docs / ".git" / "notes.txt").write_text("in a dot-folder")
    (docs / "sub").mkdir()
    (docs / "marta.txt").write_text("Marta Quill is a beekeeper who lives in Lisbon.\n")
    (docs / "sub" / "tomas.md").write_text("Tomas Elm makes violins in Cremona.\n")
    (docs / ".env").write_text("TOKEN=secret")
    (docs / "empty.txt").write_text("")
    (docs / "blank.md").write_text("  \n\n ")
    (docs / "latin1.txt").write_bytes(b"caf\xe9")
    (docs / "photo.png").write_bytes(b"\x89PNG")
    return docs


def test_folders_skip_hidden_entries_and_name_every_skipped_file(
    engine: BlendEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    docs = _folder(tmp_path)
    files = DocumentFiles()
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        paths = list_files([str(docs)], files)
        named = read_files(paths, files)
    assert [Path(name).name for name, _ in named] == ["marta.txt", "tomas.md"]
    assert sorted(Path(name).name for name in files.skipped) == [
        ".env", ".git", "blank.md", "empty.txt", "latin1.txt", "photo.png",
    ]  # fmt: skip
    messages = caplog.text
    assert "in a dot-folder" not in "".join(text for _, text in named)
    for reason in ("empty file", "blank file", "not UTF-8", "not a text file", "hidden"):
        assert reason in messages
    # a hidden file named on the command line is read
    assert list_files([str(docs / ".env")], DocumentFiles()) == [docs / ".env"]


def test_a_file_no_window_can_hold_is_skipped_by_its_characters_untokenized(
    engine: BlendEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"word " * (2 << 20))  # 10 MiB
    small = tmp_path / "small.txt"
    small.write_text("Marta lives in Lisbon.")
    files = DocumentFiles()
    named = read_files([big, small], files)
    seen = _spy_tokenize(engine, monkeypatch)
    fitting = fitting_documents(engine, named, chunk=False, files=files)
    assert [name for name, _ in fitting] == [str(small)] and files.skipped == [str(big)]
    assert seen == [len("Marta lives in Lisbon.")]  # the big one was never tokenized


def test_a_file_over_the_read_limit_is_named_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kvblend.cli.precompute as module

    monkeypatch.setattr(module, "MAX_FILE_BYTES", 1 << 20)
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * (3 << 20))
    small = tmp_path / "small.txt"
    small.write_text("Marta lives in Lisbon.")
    read: list[str] = []
    read_text = Path.read_text

    def spy(self: Path, *args: object, **kwargs: object) -> str:
        read.append(self.name)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", spy)
    files = DocumentFiles()
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        named = read_files([big, small], files)
    assert [name for name, _ in named] == [str(small)] and read == ["small.txt"]
    assert f"skipping {big}: 3 MiB, larger than a document file may be (1 MiB)" in caplog.text


def test_precompute_with_chunk_counts_the_skipped_files(
    loaded: list[dict],
    engine: BlendEngine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    docs = _folder(tmp_path)
    room = document_room(engine)
    (docs / "long.txt").write_text(" ".join(f"w{i}" for i in range(room // 2)))  # 2+ chunks
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        assert main(["precompute", str(docs), "--chunk", "--memory-only", "--threads", "1"]) == 0
    assert "long.txt: 2,264 tokens, split into 5 chunks" in caplog.text  # of 512 tokens
    last = capsys.readouterr().out.splitlines()[0]
    assert last.startswith("precomputed ") and "; 6 skipped (named above)" in last
    assert loaded == [loaded[0]] and loaded[0]["threads"] == 1


def test_ask_splits_a_long_file_and_retrieves_the_chunks_that_fit(
    loaded: list[dict],
    engine: BlendEngine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A file longer than the window used to be skipped (or, with --chunk, every chunk went into
    one prompt, which could not fit): now it is chunked and the question retrieves what fits."""
    room = document_room(engine)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "marta.txt").write_text("Marta Quill is a beekeeper who lives in Lisbon.")
    long = " ".join(f"w{i}" for i in range(room))  # every chunk a text of its own
    (docs / "long.txt").write_text(long)
    question = ["ask", "Where does Marta Quill live?", "--docs", str(docs), "--memory-only"]
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        code = main([*question, "--max-new-tokens", "2", "--retriever", "bm25"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "long.txt: more than" in caplog.text and "split into 10 chunks" in caplog.text
    (line,) = [line for line in err.splitlines() if line.startswith("retrieved ")]
    assert line.startswith("retrieved ") and " of 11 documents for the question (BM25; " in line
    used = line.split("): ")[1].split(", ")
    assert used[0] == str(docs / "marta.txt") and 1 < len(used) < 11  # the best first
    # only the documents in the prompt were precomputed
    pieces = fitting_documents(
        engine, [(str(docs / "long.txt"), long)], chunk=True, chunk_tokens=512
    )
    assert len(pieces) == 10
    assert {name for name, text in pieces if engine.is_known(text)} == set(used[1:])


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["ask", "  ", "--docs", "{doc}"], {}, "the question is empty"),
        (["explain", ""], {}, "the prompt is empty"),
        (
            ["ask", "q?", "--docs", "{doc}"],
            {"KVBLEND_DECODE_CACHE": "huge"},
            "KVBLEND_DECODE_CACHE must be one of static, dynamic, got 'huge'",
        ),
        (["demo"], {"KVBLEND_DECODE_COMPILE": "yes"}, "KVBLEND_DECODE_COMPILE must be one of"),
        (
            ["ask", "q?", "--docs", "{doc}", "--max-new-tokens", "1e12"],
            {},
            "--max-new-tokens: expected a whole number, got '1e12'",
        ),
        (["demo", "--max-new-tokens", "0"], {}, "--max-new-tokens: must be at least 1"),
    ],  # fmt: skip
)
def test_mistakes_are_refused_before_the_model_loads(
    loaded: list[dict],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
    message: str,
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("Marta lives in Lisbon.")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main([arg.replace("{doc}", str(doc)) for arg in argv] + ["--memory-only"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert loaded == []  # no model was loaded


def test_max_new_tokens_is_bounded_by_the_window(
    loaded: list[dict], engine: BlendEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("Marta lives in Lisbon.")
    argv = ["ask", "q?", "--docs", str(doc), "--memory-only"]
    assert main([*argv, "--max-new-tokens", str(10**12)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"kvblend: error: --max-new-tokens {10**12} leaves no room for a prompt in "
        f"{engine.name}'s context window of {engine.context_window} tokens"
    )


def test_each_help_lists_only_the_options_its_command_uses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    helps = {}
    for command in ("demo", "precompute", "ask", "explain"):
        assert main([command, "--help"]) == 0
        helps[command] = capsys.readouterr().out
    blend = ("--strategy", "--ratio", "--deviation", "--correction", "--set")
    for option in (*blend, "--max-new-tokens"):
        assert option not in helps["precompute"]
    assert "--max-new-tokens" not in helps["explain"]
    for command in ("demo", "ask", "explain"):
        assert all(option in helps[command] for option in blend)
    assert "--chunk" in helps["ask"] and "--chunk" in helps["precompute"]
    assert all("--threads" in text for text in helps.values())


def test_help_imports_no_torch_and_states_the_real_defaults() -> None:
    code = (
        "import sys\n"
        "from kvblend.cli.main import main\n"
        "for argv in (['--help'], ['precompute', '--help'], ['explain', '--help']):\n"
        "    assert main(argv) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"kvblend --help and two subcommand helps: {time.perf_counter() - started:.2f} s")
    assert done.returncode == 0, done.stderr
    assert "--threads" in done.stdout and "--chunk" in done.stdout
    assert STRATEGIES[0] == BlendConfig().strategy
    assert set(STRATEGIES) == set(strategy_names())
    for setting, defaults in (
        ("recompute_ratio", DEFAULT_RATIO),
        ("correction", DEFAULT_CORRECTION),
    ):
        expected = {
            name: BlendConfig(name).settings[setting]
            for name in STRATEGIES
            if setting in BlendConfig(name).settings
        }
        assert defaults == expected, setting


def test_explain_does_not_warn_of_a_question_quoting_a_reused_document(
    loaded: list[dict],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    document = "Marta Quill is a beekeeper who lives in Lisbon with her three dogs."
    doc = tmp_path / "marta.txt"
    doc.write_text(document)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(f"Context: {document}\n\nQuestion: what does '{document[:20]}' mean?")
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        code = main(["explain", "--file", str(prompt), "--docs", str(doc), "--memory-only"])
    out = capsys.readouterr().out
    assert code == 0 and "1 document(s) found" in out
    assert "near miss" not in out and "near" not in caplog.text
