"""Several processes share one real `redis-server`: one precomputes, four others reuse.

The writer precomputes a corpus into memory -> disk -> Redis (and answers one question, which
stores the prompt head). Four reader processes, each with its own empty memory and disk tiers,
answer questions over the corpus: they must reuse the stored KV (reused tokens > 0) without
computing any segment, and give exactly the answers of a single process. In a second run the
server is killed and restarted (empty) while four fresh readers are answering, with every
lookup crossing the network: every answer must still equal the single-process one, and no
reader may raise.
"""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest

CORPUS = [
    "Lena Park plays the violin in the city orchestra.",
    "Marta Quill lives in Lisbon and paints harbours.",
    "Tomas Reyes repairs bicycles in Valencia.",
    "The lighthouse on Kestrel Point was built in 1871.",
    "Oren Vale grows saffron on a hill near Kozani.",
    "The night train to Vienna leaves at nine.",
]
QUESTIONS = [
    ("What does Lena play?", [0, 1, 2]),
    ("Where does Marta live?", [2, 1, 0]),
    ("Who repairs bicycles?", [3, 2, 4]),
    ("When was the lighthouse built?", [5, 3, 1]),
    ("What grows near Kozani?", [4, 0, 5]),
    ("When does the train leave?", [1, 5, 2]),
]


def _engine(store):
    sys.path.insert(0, str(Path(__file__).parents[1]))
    import torch

    from conftest import byte_tokenizer, tiny_model
    from kvblend import BlendEngine

    torch.set_num_threads(1)
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store, name="llama")


def _answer(engine, index: int) -> tuple[str, int, int]:
    question, order = QUESTIONS[index]
    out = engine.generate(
        engine.rag_segments(question, [CORPUS[i] for i in order]), max_new_tokens=6
    )
    return out.text, out.stats.segments_precomputed, out.stats.reused_tokens


def _reference() -> list[str]:
    from kvblend.store import MemoryKVStore

    engine = _engine(MemoryKVStore())
    engine.precompute(CORPUS)
    return [_answer(engine, index)[0] for index in range(len(QUESTIONS))]


def _writer(url: str, folder: str) -> int:
    from kvblend.store import default_store

    engine = _engine(default_store(folder, redis_url=url))
    engine.precompute(CORPUS)
    _answer(engine, 0)  # stores the prompt head too
    return len(CORPUS)


def _reader(url: str, folder: str, network_only: bool, started, go) -> list:
    """Answer every question; report (answer, segments computed, reused tokens) or the error."""
    from kvblend.store import MemoryKVStore, RedisKVStore, RemoteTieredKVStore, default_store

    if network_only:  # nothing kept locally: every lookup reads Redis
        remote = RedisKVStore(url, retry_after_s=0.1, max_retry_after_s=0.2)
        store = RemoteTieredKVStore(MemoryKVStore(0), None, remote=remote)
    else:
        store = default_store(folder, redis_url=url)
    engine = _engine(store)
    results = []
    for round_ in range(3 if network_only else 1):
        for index in range(len(QUESTIONS)):
            try:
                results.append(_answer(engine, index))
            except Exception as error:  # noqa: BLE001 - reported to the test, which fails
                results.append(f"{type(error).__name__}: {error}")
            if round_ == 0 and index == 0:
                started.release()
                go.wait(60)
    return results


@pytest.mark.slow
def test_readers_reuse_what_the_writer_stored_and_survive_a_restart(redis_server, tmp_path):
    # A generous timeout (a redis-py URL option): on a loaded machine a slow reply must not
    # turn into a miss in the first run, where nothing may be computed.
    url = redis_server.url + "?socket_timeout=30"
    context = multiprocessing.get_context("spawn")
    with context.Pool(5) as pool:
        reference = pool.apply_async(_reference)
        assert pool.apply(_writer, (url, str(tmp_path / "writer"))) == len(CORPUS)
        manager = context.Manager()
        started, go = manager.Semaphore(0), manager.Event()
        go.set()
        readers = [
            pool.apply_async(_reader, (url, str(tmp_path / f"r{n}"), False, started, go))
            for n in range(4)
        ]
        expected = reference.get(600)
        for reader in readers:
            results = reader.get(600)
            assert [result[0] for result in results] == expected
            assert all(computed == 0 and reused > 0 for _, computed, reused in results), results

        # Second run: the server dies and comes back empty while fresh readers are answering.
        go.clear()
        readers = [
            pool.apply_async(
                _reader, (redis_server.url, str(tmp_path / f"s{n}"), True, started, go)
            )
            for n in range(4)
        ]
        for _ in readers:
            assert started.acquire(timeout=600)  # every reader answered once from Redis
        redis_server.kill()
        go.set()
        redis_server.start()
        recomputed = 0
        for reader in readers:
            results = reader.get(600)
            assert all(isinstance(result, tuple) for result in results), results
            assert [result[0] for result in results] == expected * 3
            recomputed += sum(computed for _, computed, _ in results)
        assert recomputed > 0  # the restarted server was empty: segments were computed again
        manager.shutdown()


# ------------------------------------------------------- 3 processes x 3 threads, one folder
DOCUMENTS = [f"{text} It is note {n} of the town archive." for n, text in enumerate(CORPUS * 2)]
THREADS = 3


def _busy_process(url: str, folder: str, worker: int, store_key: str) -> dict:
    """Three threads sharing one engine over one folder and one server: precompute and answer.

    Returns every answer given and every document this process precomputed.
    """
    import os
    import threading

    if store_key:
        os.environ["KVBLEND_STORE_KEY"] = store_key
    from kvblend.store import default_store

    engine = _engine(default_store(folder, redis_url=url))
    answers: list[tuple[int, str]] = []
    written: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()

    def work(thread: int) -> None:
        offset = 3 * worker + thread
        mine = [DOCUMENTS[(offset + step) % len(DOCUMENTS)] for step in range(4)]
        try:
            engine.precompute(mine)
            got = [(i, _answer(engine, i)[0]) for i in ((offset + s) % 6 for s in range(2))]
        except Exception as error:  # noqa: BLE001 - reported to the test, which fails
            with lock:
                errors.append(f"{type(error).__name__}: {error}")
            return
        with lock:
            written.extend(mine)
            answers.extend(got)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    engine.store.wait_for_promotions()
    stats = engine.store.stats()
    return {
        "answers": answers,
        "written": written,
        "errors": errors,
        "corrupt": stats.corrupt_dropped,
        "put_errors": stats.put_errors,
    }


def _intact(url: str, folder: str, store_key: str) -> dict[str, int]:
    """How many precomputed documents are whole in the folder alone and on the server alone."""
    import os

    if store_key:
        os.environ["KVBLEND_STORE_KEY"] = store_key
    from kvblend.store import DiskKVStore, RedisKVStore

    found = {}
    for tier, store in (("disk", DiskKVStore(folder)), ("redis", RedisKVStore(url))):
        engine = _engine(store)
        found[tier] = sum(engine.library.segment_kv.intact(engine.segment_id(d)) for d in DOCUMENTS)
        store.close()
    return found


@pytest.mark.slow  # three processes that import torch
@pytest.mark.parametrize("store_key", ["", "9" * 64], ids=["checksums", "macs"])
def test_three_processes_of_three_threads_lose_nothing(redis_server, tmp_path, store_key):
    url = redis_server.url + "?socket_timeout=30"
    folder = str(tmp_path / "shared")
    context = multiprocessing.get_context("spawn")
    with context.Pool(3) as pool:
        reference = pool.apply_async(_reference)
        runs = [pool.apply_async(_busy_process, (url, folder, n, store_key)) for n in range(3)]
        expected = reference.get(900)
        results = [run.get(900) for run in runs]
        intact = pool.apply(_intact, (url, folder, store_key))
    answers = [answer for result in results for answer in result["answers"]]
    wrong = [(index, text) for index, text in answers if text != expected[index]]
    assert [result["errors"] for result in results] == [[]] * 3
    assert len(answers) == 3 * THREADS * 2 and wrong == []  # 0 wrong answers
    written = {doc for result in results for doc in result["written"]}
    assert written == set(DOCUMENTS)
    assert intact == {"disk": len(DOCUMENTS), "redis": len(DOCUMENTS)}  # 0 lost writes
    assert [(r["corrupt"], r["put_errors"]) for r in results] == [(0, 0)] * 3
