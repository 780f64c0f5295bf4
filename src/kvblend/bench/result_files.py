"""Where benchmark results go, and how each is written: JSON with its machine and command.

Results go to `RESULTS_DIR`: ``$KVBLEND_BENCH_DIR``, else ``kvblend-bench/`` in the current
folder, so a run from a clone never overwrites the results the project records in
``benchmarks/results/`` (`RECORDED_DIR`, tracked by git): recording one there takes
``--output benchmarks/results/NAME.json``. `write_result` writes a result as JSON, with the
command that ran it (`running_command`) and the default config of the day, and its Markdown
table beside it, headed by the model, its dtype and the thread count (`describe_machine`);
it prints the table too.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

#: Environment variable naming the folder results go to by default.
BENCH_DIR_ENV = "KVBLEND_BENCH_DIR"
#: The results the project records (tracked): read by `report` and `headline`, written only
#: when a command is given ``--output`` there.
RECORDED_DIR = Path("benchmarks") / "results"


def results_dir() -> Path:
    """Return ``$KVBLEND_BENCH_DIR``, else ``kvblend-bench`` in the current folder."""
    override = os.environ.get(BENCH_DIR_ENV)
    return Path(override).expanduser() if override else Path("kvblend-bench")


#: Where results go by default (never `RECORDED_DIR`, unless asked for).
RESULTS_DIR = results_dir()


def running_command() -> str:
    """Return the running command as a user would type it (recorded with each result)."""
    arguments = sys.argv[1:]
    if Path(sys.argv[0]).name == "kvblend":
        return shlex.join(["kvblend", *arguments])
    return shlex.join(["python", "-m", "kvblend.bench", *arguments])


def describe_machine(engine: Any) -> dict[str, Any]:
    """Describe the machine ``engine`` runs on: model, device, dtype and why, threads, versions."""
    device = engine.decoder.device
    return {
        "model": engine.name,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "dtype": str(engine.decoder.dtype).replace("torch.", ""),
        "dtype_reason": engine.dtype_choice.reason,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def write_result(result: dict[str, Any], path: Path, table: str) -> None:
    """Write ``result`` to ``path`` (JSON) and ``table`` beside it (``.md``); print the table.

    The result records the command that ran it and the default config unless it holds them;
    a result with its machine's dtype heads the table with the model, the dtype and why, and
    the thread count.
    """
    from kvblend.blend.config import BlendConfig

    result.setdefault("command", running_command())
    result.setdefault("default_config", repr(BlendConfig()))  # what "default" meant
    machine = result.get("machine") or {}
    if machine.get("dtype"):  # every table says what the model computed in
        threads = f", {machine['torch_threads']} thread(s)" if machine.get("torch_threads") else ""
        reason = f" ({machine['dtype_reason']})" if machine.get("dtype_reason") else ""
        table = f"{machine.get('model', '')}, {machine['dtype']}{reason}{threads}\n\n{table}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    path.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
