"""The benchmarked engine, loaded from a subcommand's options the way the docs tell users to."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch


def load_engine(args: argparse.Namespace, system_prompt: str) -> Any:
    """Load the benchmarked engine, configured as the docs tell users to.

    Its system prompt is the one the benchmark's prompts use, so documents are precomputed
    behind that prompt head (``--engine-system`` overrides it; ``--doc-prefix bos`` drops it).
    Documents' KV is kept in memory, or in ``--store-dir`` where the subcommand has it (a
    later run reads what an earlier one computed).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    from kvblend.bench.models import BenchModelMissing, resolve_model
    from kvblend.command_line import check_device
    from kvblend.engine.engine import BlendEngine
    from kvblend.store import MemoryKVStore

    check_device(args.device)  # one line for `--device gpu`, before the model loads
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    doc_prefix = getattr(args, "doc_prefix", "auto")
    engine_system = getattr(args, "engine_system", None)
    store_dir = getattr(args, "store_dir", None)
    store: Any = MemoryKVStore(8 << 30)
    if store_dir:  # documents' KV kept on disk: a later run reads what an earlier one computed
        from kvblend.store import default_store

        store = default_store(store_dir, disk_bytes=64 << 30)
    try:
        model = resolve_model(args.model)
    except BenchModelMissing as error:
        raise SystemExit(str(error)) from None
    return BlendEngine.from_pretrained(
        model,
        store=store,
        device=args.device,
        dtype=args.dtype,
        system_prompt=system_prompt if engine_system is None else engine_system,
        doc_prefix=None if doc_prefix == "bos" else "auto",
        threads=args.threads or None,  # else a count equal to torch's own is not kept
    )
