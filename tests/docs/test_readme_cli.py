"""A new user's path runs as written: the README's command-line block, line by line, in a clone.

The block is read from the README itself; each ``kvblend`` line runs through the command line's
own `main` (with a tiny random model standing in for the bundled one: this checks the paths,
files and options the lines name, not answers, which ``tests/cli/test_cli.py`` checks on the
bundled model), each other line (``mkdir``, ``echo``) through ``bash``, in a folder laid out as a
clone is, with its own store folder. Every line must succeed, what the lines name must exist
when they need it, and the clone holds no new file afterwards. The cookbook's documented
runner (``pytest --nbmake``) must be what the install provides.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import smollm2_tiny_llama
from kvblend import BlendEngine
from kvblend.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    """The lines of the README's command-line block, comments and continuations dropped."""
    text = (ROOT / "README.md").read_text("utf-8")
    section = text[text.index("## Command line\n") :]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the README's Command line section has no bash block"
    lines = []
    for line in block.group(1).splitlines():
        words = shlex.split(line, comments=True)
        if words:
            lines.append(shlex.join(words) if words[0] == "kvblend" else line.split("  #")[0])
    return lines


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, object]:
    """A one-layer random Llama over the bundled model's own tokenizer, answering at once.

    Its EOS logit is raised above every other, so each answer is one token: the demo's twelve
    answers cost milliseconds, and every prompt of the block fits its 4K-token window.
    """
    model, tokenizer = smollm2_tiny_llama(max_position_embeddings=4096)
    eos = tokenizer.eos_token_id

    def stop_at_once(module: object, inputs: object, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., eos] += 1e4
        return logits

    model.lm_head.register_forward_hook(stop_at_once)
    return model, tokenizer


def test_the_readme_command_line_runs_as_written_in_a_clone(
    tiny: tuple[torch.nn.Module, object],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def from_pretrained(cls, model=None, *, store, **kwargs):  # noqa: ANN001, ANN202
        return BlendEngine(*tiny, store=store)

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    clone = tmp_path / "kvblend"
    (clone / "docs").mkdir(parents=True)  # what a clone holds where the old examples pointed
    monkeypatch.chdir(clone)
    monkeypatch.setenv("KVBLEND_STORE_DIR", str(tmp_path / "store"))
    lines = readme_commands()
    assert any(line.startswith("kvblend ask") for line in lines)
    ran = []
    for line in lines:
        words = shlex.split(line)
        if words[0] in (".", "source"):
            continue  # the virtualenv: this interpreter is already it
        if words[0] == "kvblend":
            code = main(words[1:])
            captured = capsys.readouterr()
            assert code == 0, f"{line!r} exited {code}:\n{captured.err[-2000:]}"
            ran.append((words[1], captured.out))
            if words[1] == "demo":  # where its KV went, and how to remove it
                assert f"kept in {tmp_path / 'store'}" in captured.err
                assert "`kvblend store clear` deletes it" in captured.err
        else:
            assert words[0] in ("mkdir", "echo", "printf"), f"{line!r}: not a setup line"
            subprocess.run(["bash", "-c", line], check=True)
    said = {command: out for command, out in ran}  # the last of each command
    explained = [out for command, out in ran if command == "explain"]
    assert explained and "1 document(s) found" in explained[0]  # the note precomputed above
    assert any("entries:" in out for command, out in ran if command == "store")
    assert said["store"].startswith("cleared ") and not list((tmp_path / "store").rglob("*.val"))
    # the block leaves nothing in the clone (its notes go to /tmp, its KV to the store folder)
    assert sorted(path.name for path in clone.iterdir()) == ["docs"], list(clone.iterdir())


def test_the_cookbook_runner_the_notebooks_name_is_installed() -> None:
    import json

    for notebook in sorted((ROOT / "cookbook").glob("*.ipynb")):
        intro = "".join(json.loads(notebook.read_text())["cells"][0]["source"])
        assert f"pytest --nbmake cookbook/{notebook.name}" in intro, notebook.name
    import ipykernel  # noqa: F401 - what `--nbmake` runs the notebooks with
    import nbmake  # noqa: F401
