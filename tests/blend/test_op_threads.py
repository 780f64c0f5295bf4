"""CPU threads of the blend loop's ops: one thread but for the ops that pay for more, now.

`small_ops` runs a layer on one thread and `big` gives an op the caller's count back only when
the cores are idle enough and the op long enough (`Cores` reads the other processes' busy cores
from ``/proc/stat``). The count is the caller's again wherever the loop may pause (its cancel
flag: the vLLM connector runs vLLM's forward there).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvblend import BlendConfig
from kvblend.bench.speed.ops import byte_engine, rag_prompt, random_documents
from kvblend.blend import op_threads as threads


class _Idle:
    """`Cores` of a machine whose cores are all idle: every thread, for ops of any size."""

    def threads(self, wanted: int) -> tuple[int, float]:
        return wanted, 0.0


class _Busy:
    """`Cores` of a machine whose other cores are all busy: one thread for every op."""

    def threads(self, wanted: int) -> tuple[int, float]:
        return 1, 0.0


@pytest.fixture
def two_threads() -> object:
    own = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(own)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize(("cores", "wide"), [(_Idle(), 2), (_Busy(), 1)])
def test_small_ops_run_on_one_thread_and_big_ones_on_the_idle_cores(
    cores: object, wide: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(threads, "_CORES", cores)
    cpu = torch.device("cpu")
    with threads.small_ops(cpu):
        assert torch.get_num_threads() == 1
        with threads.big(threads.RATE):  # a second of one thread's work
            assert torch.get_num_threads() == wide
        assert torch.get_num_threads() == 1
        with threads.small_ops(cpu):  # nested: nothing changes
            assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), threads.small_ops(cpu):
        raise RuntimeError("an op failed")
    assert torch.get_num_threads() == 2  # restored all the same
    with threads.big(threads.RATE):  # outside a region: the caller's count
        assert torch.get_num_threads() == 2
    with threads.small_ops(torch.device("meta")):  # not the CPU: nothing changes
        assert torch.get_num_threads() == 2


def test_the_busy_cores_of_other_processes_are_read_from_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    now, own = [10.0], [0.0]

    def write(busy: int, idle: int) -> None:  # clock ticks, summed over both cores
        stat.write_text(
            f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n"
            "cpu1 0 0 0 0 0 0 0 0 0 0\nintr 0\n"
        )

    write(0, 0)
    cores = threads.Cores(str(stat), clock=lambda: now[0], own_cpu=lambda: own[0])
    hz = round(1 / cores.tick)
    assert cores.count == 2 and cores.threads(2)[0] == 2  # nothing known yet: idle
    # one second: both cores busy, one of them with this process
    now[0], own[0] = 11.0, 1.0
    write(2 * hz, 0)
    assert cores.busy_elsewhere() == pytest.approx(1.0)  # the moving average over 0.5 s
    assert cores.threads(2)[0] == 1  # no idle core for a second thread
    # two seconds: this process alone on both cores
    now[0], own[0] = 13.0, 5.0
    write(6 * hz, 0)
    assert cores.busy_elsewhere() == pytest.approx(0.0)
    threads_, least = cores.threads(2)
    assert threads_ == 2 and least == pytest.approx(threads.RATE * threads.MIN_WIDE_S)
    assert threads.Cores(str(tmp_path / "missing")).busy_elsewhere() == 0.0  # not Linux


@pytest.mark.usefixtures("two_threads")
def test_the_loop_gives_the_callers_thread_count_back_where_it_may_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cancel flag (where the vLLM connector pauses a blend and runs its own forward on
    the same thread) sees the caller's thread count, and the logits are the one-thread ones."""
    monkeypatch.setattr(threads, "_CORES", _Idle())
    engine = byte_engine(3, hidden=32)
    documents = random_documents(4, 150, seed=2)
    engine.precompute([text + "\n" for text in documents], progress=False)
    seen: list[int] = []

    class Flag(threading.Event):
        def is_set(self) -> bool:
            seen.append(torch.get_num_threads())
            return False

    prompt = rag_prompt(documents)
    got = engine.prefill(prompt, BlendConfig(), cancel=Flag())
    assert seen and set(seen) == {2} and torch.get_num_threads() == 2
    torch.set_num_threads(1)
    expected = engine.prefill(prompt, BlendConfig())
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=0)
