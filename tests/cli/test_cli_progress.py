"""Progress on a long precompute: reports before, during and after each batch, a bar with bytes.

`PrecomputeProgress` reports come before anything is computed (with the store's expected
growth), between the layers of a batch's pass (so a bar moves long before the first entry is
written) and after each batch; the bytes they count are the tensors the store hands back. The
command line prints the bar on a terminal only (a pseudo-terminal here), not under ``--quiet``
or into a pipe, says how much the store grows before a large precompute, and counts new,
already stored and skipped documents apart in its last line.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.cli.main import main
from kvblend.cli.report import PrecomputeTally, summary
from kvblend.documents.progress import PrecomputeProgress, format_bytes
from kvblend.store import MemoryKVStore

DOCUMENTS = [
    f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(40 + 9 * i)) for i in range(5)
]


@pytest.fixture
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


def test_reports_come_before_during_and_after_each_batch(engine: BlendEngine) -> None:
    reports: list[PrecomputeProgress] = []
    ids = engine.library.precompute(DOCUMENTS, batch_tokens=1, report=reports.append)
    first, last = reports[0], reports[-1]
    assert (first.documents, first.already_stored, first.computed, first.tokens_done) == (
        5,
        0,
        0,
        0,
    )
    assert first.bytes_expected > 0 and first.tokens > sum(len(d) for d in DOCUMENTS) - 1
    # between the layers of the first batch (one document: batch_tokens=1), before it is stored
    during = [r for r in reports if r.computed == 0 and 0 < r.tokens_done < first.tokens]
    assert during, reports[:6]
    # the bytes counted are those of the tensors the store hands back
    stored = sum(t.nbytes for key in ids for t in engine.store.get(key).values())
    assert last.computed == 5 and last.tokens_done == last.tokens == first.tokens
    assert last.bytes_written == last.bytes_expected == stored
    assert [r.tokens_done for r in reports] == sorted(r.tokens_done for r in reports)
    # a second call computes nothing: every document is already stored
    again: list[PrecomputeProgress] = []
    engine.library.precompute(DOCUMENTS, report=again.append)
    assert [(r.already_stored, r.tokens, r.bytes_expected) for r in again] == [(5, 0, 0)]


def test_the_summary_counts_new_stored_and_skipped_apart(engine: BlendEngine) -> None:
    tally = PrecomputeTally(quiet=True)
    engine.library.precompute(DOCUMENTS[:2], report=tally)
    tally.finish_call()
    engine.library.precompute(DOCUMENTS, report=tally)
    tally.finish_call()
    assert (tally.computed, tally.already_stored) == (5, 2)
    line = summary(tally, skipped=1, seconds=1.0)
    assert line.startswith("precomputed 5 new documents in 1.0 s (")
    assert "; 2 documents already stored; 1 skipped (named above)" in line
    repeat = PrecomputeTally(quiet=True)
    engine.library.precompute(DOCUMENTS, report=repeat)
    repeat.finish_call()
    assert summary(repeat, 0, 0.0) == "nothing to compute: all 5 documents already stored"


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 3 << 20, 5 << 30)] == [
        "0 B", "1023 B", "1.0 KiB", "3.0 MiB", "5.0 GiB"
    ]  # fmt: skip


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[BlendEngine]:
    engines: list[BlendEngine] = []

    def from_pretrained(cls, model=None, *, store, **kwargs):  # noqa: ANN001, ANN202
        engines.append(BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store))
        return engines[-1]

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    return engines


def test_a_large_precompute_says_how_much_the_store_grows_and_quiet_says_nothing(
    loads: list[BlendEngine],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kvblend.cli.report.LARGE_PRECOMPUTE_BYTES", 1)
    doc = tmp_path / "a.txt"
    doc.write_text(DOCUMENTS[0])
    assert main(["precompute", str(doc), "--memory-only"]) == 0
    err = capsys.readouterr().err
    assert "precomputing 1 document (" in err and "the store grows by about" in err
    assert main(["precompute", str(doc), "--memory-only", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("precomputed 1 new document")


#: A child process whose model loads give the tiny engine, running the command line.
CHILD = """
import sys
from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.cli.main import main

def from_pretrained(cls, model=None, *, store, **kwargs):
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store)

BlendEngine.from_pretrained = classmethod(from_pretrained)
sys.exit(main(sys.argv[1:]))
"""


def _run_in_terminal(argv: list[str], cwd: Path) -> tuple[int, str, float | None]:
    """Run the command line on a pseudo-terminal (120 columns); return its status, its output
    and the seconds from its start to the first bar line that counts bytes written."""
    main_fd, child_fd = pty.openpty()
    os.set_blocking(main_fd, False)
    import fcntl
    import struct
    import termios

    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv], stdin=child_fd, stdout=child_fd, stderr=child_fd,
        cwd=cwd, env=env, close_fds=True,
    )  # fmt: skip
    os.close(child_fd)
    output, first_bar = b"", None
    deadline = started + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main_fd], [], [], 0.2)
        if not ready:
            if child.poll() is not None:
                break
            continue
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
        if first_bar is None and b" of ~" in output:
            first_bar = time.monotonic() - started
    else:
        child.kill()
    os.close(main_fd)
    return child.wait(), output.decode("utf-8", "replace"), first_bar


@pytest.mark.slow  # three processes that import torch
def test_the_bar_shows_on_a_terminal_and_not_in_a_pipe(tmp_path: Path) -> None:
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join(f"w{i}" for i in range(3000)))  # longer than the tiny window
    argv = ["precompute", str(doc), "--chunk", "--memory-only", "--threads", "1"]
    code, output, first_bar = _run_in_terminal(argv, tmp_path)
    assert code == 0, output
    assert "precomputing KV:" in output and "docs, wrote " in output and " of ~" in output
    assert first_bar is not None
    code, quiet, _ = _run_in_terminal([*argv, "--quiet"], tmp_path)
    assert code == 0 and "precomputing KV" not in quiet and "loading model" not in quiet
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    piped = subprocess.run(
        [sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    assert piped.returncode == 0 and "precomputing KV" not in piped.stderr, piped.stderr


def test_the_libraries_bars_follow_quiet_and_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF file's conversion shows transformers' own tqdm bar: hidden under --quiet and off a
    terminal (``TQDM_DISABLE``, tqdm's default for a bar that does not choose)."""
    import argparse
    import io

    from kvblend.cli.main import _quiet_other_bars

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for quiet, stderr, hidden in [(False, Terminal(), False), (True, Terminal(), True),
                                  (False, io.StringIO(), True)]:  # fmt: skip
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
        monkeypatch.setattr(sys, "stderr", stderr)
        _quiet_other_bars(argparse.Namespace(quiet=quiet))
        assert (os.environ.get("TQDM_DISABLE") == "1") == hidden, (quiet, stderr)


def test_on_a_cpu_each_chunk_is_written_as_it_is_computed(
    loads: list[BlendEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bar's bytes move from the first chunk on, not once a 4,096-token batch is done."""
    import kvblend.cli.main as cli_main

    seen: list[PrecomputeProgress] = []

    class Recording(PrecomputeTally):
        def __call__(self, progress: PrecomputeProgress) -> None:
            seen.append(progress)
            super().__call__(progress)

    monkeypatch.setattr(cli_main, "PrecomputeTally", Recording)
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join(f"w{i}" for i in range(3000)))  # ~17,000 tokens of the tiny model
    assert main(["precompute", str(doc), "--chunk", "--memory-only", "--quiet"]) == 0
    total = seen[0].to_compute
    assert total > 8
    written = [state for state in seen if state.bytes_written and state.computed < total]
    assert written and written[0].computed == 1  # the first chunk, stored alone
