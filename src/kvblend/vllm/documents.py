"""The documents a connector side finds and reads: the same store, registry and keys as the engine.

Both sides of the connector build a `DocumentLibrary` over the store every kvblend process shares
(``$KVBLEND_STORE_DIR`` / ``$KVBLEND_REDIS_URL``, or the connector's settings), for the model
vLLM serves. Entries are keyed by the engine's model fingerprint, the one `BlendEngine` computes
(transformers' model over the same folder, in vLLM's dtype), read from the folder's checkpoint
a weight at a time (`kvblend.models.checkpoint`: no second copy of the model in memory), so a
store filled by ``kvblend precompute --model FOLDER`` serves the connector and the other way
round. The fingerprint is remembered on disk, keyed by the folder files' content hashes, so it
is computed once per model, not at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvblend.blend.adapter import DecoderShape
from kvblend.documents.library import DocumentLibrary
from kvblend.models.checkpoint import checkpoint_fingerprint
from kvblend.models.fingerprint import model_fingerprint
from kvblend.models.loading import cache_dir, file_digest
from kvblend.prompt.templates import rag_prefix
from kvblend.vllm.fallbacks import NO_DOCUMENT, RequestFallback
from kvblend.vllm.settings import ConnectorSettings

logger = logging.getLogger(__name__)

__all__ = [
    "ShapeOnly",
    "StoreSummary",
    "folder_fingerprint",
    "open_library",
    "open_tokenizer",
    "store_location",
]


class ShapeOnly:
    """The scheduler side's stand-in for a model: its sizes, and no weights to compute with."""

    def __init__(self, shape: DecoderShape, dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device("cpu")


def open_tokenizer(model_config: Any) -> Any:
    """Load the Hugging Face tokenizer of the model vLLM serves (the files vLLM reads)."""
    from transformers import AutoTokenizer

    source = model_config.tokenizer or model_config.model
    revision = model_config.tokenizer_revision
    trust = bool(model_config.trust_remote_code)
    return AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust)


def _memo_key(folder: Path, dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Return a key naming the folder's content, dtypes and transformers version (or None)."""
    if not folder.is_dir():
        return None
    import transformers

    digest = hashlib.sha256(f"{dtype}|{kv_dtype}|{transformers.__version__}".encode())
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            digest.update(f"|{path.name}={file_digest(path)}".encode())
    return digest.hexdigest()


def _memo_file() -> Path:
    return cache_dir() / "fingerprints.json"


def _read_memo() -> dict[str, str]:
    try:
        memo = json.loads(_memo_file().read_text("utf-8"))
        return {str(k): str(v) for k, v in memo.items()} if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_memo(key: str, fingerprint: str) -> None:
    memo = _read_memo()
    memo[key] = fingerprint
    try:
        _memo_file().parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".fingerprints-", dir=_memo_file().parent)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(memo, out)
        os.replace(temporary, _memo_file())
    except OSError as error:  # computed again next time
        logger.debug("could not remember the model fingerprint: %s", error)


def folder_fingerprint(model_config: Any, tokenizer: Any, kv_dtype: torch.dtype) -> str:
    """Return the engine's `model_fingerprint` of the model vLLM serves, in vLLM's dtype.

    Read from the folder's checkpoint a weight at a time (`checkpoint_fingerprint`: no second
    copy of the model in memory); a folder that cannot be read so is loaded by transformers
    (on the CPU) once. Either way the result is remembered under the folder files' content
    hashes, so it is computed once per model, not at every start.
    """
    dtype = model_config.dtype
    folder = Path(str(model_config.model)).expanduser()
    key = _memo_key(folder, dtype, kv_dtype)
    if key is not None and key in (memo := _read_memo()):
        return memo[key]
    trust = bool(model_config.trust_remote_code)
    fingerprint = None
    if model_config.revision is None:  # a folder, not a hub revision
        fingerprint = checkpoint_fingerprint(
            folder, tokenizer, dtype, kv_dtype, trust_remote_code=trust
        )
    if fingerprint is None:
        from transformers import AutoModelForCausalLM

        logger.info("kvblend: loading %s once to compute its fingerprint", folder)
        model = AutoModelForCausalLM.from_pretrained(
            str(model_config.model),
            dtype=dtype,
            device_map="cpu",
            revision=model_config.revision,
            trust_remote_code=trust,
        )
        fingerprint = model_fingerprint(model, tokenizer, kv_dtype)
        del model
    if key is not None:
        _write_memo(key, fingerprint)
    return fingerprint


def open_library(
    settings: ConnectorSettings,
    model_config: Any,
    decoder: Any,
    tokenizer: Any,
    fingerprint: str,
) -> DocumentLibrary:
    """Open a connector side's documents over the shared store, for ``decoder`` (or `ShapeOnly`)."""
    from kvblend.store import default_store

    store = default_store(settings.store_dir, redis_url=settings.redis_url)
    name = Path(str(model_config.model)).name or str(model_config.model)
    doc_prefix = rag_prefix(tokenizer, settings.system_prompt)
    return DocumentLibrary.open(
        decoder,
        tokenizer,
        store,
        fingerprint=fingerprint,
        model_name=name,
        doc_prefix=doc_prefix,
        codec=settings.kv_codec,
    )


def config_shape(model_config: Any) -> DecoderShape:
    """Return the model's `DecoderShape` as the store keeps it: every KV head."""
    config = model_config.hf_config  # transformers' config: its optional fields read as such
    heads = int(config.num_attention_heads)
    return DecoderShape(
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", heads)),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
    )


def store_location(settings: ConnectorSettings) -> str:
    """Where the connector's store lives, as a log line names it (a Redis password hidden)."""
    from kvblend.store.disk import default_store_dir

    folder = Path(settings.store_dir).expanduser() if settings.store_dir else default_store_dir()
    where = f"disk {folder}"
    url = settings.redis_url or os.environ.get("KVBLEND_REDIS_URL")
    if url:
        from kvblend.store.redis.access import redacted

        where += f" + Redis {redacted(url)}"
    return where


class StoreSummary:
    """What the store holds, by model: the start-up log line and why a prompt finds nothing.

    Entries name the model and fingerprint they were computed with (their metadata); listing
    them costs a read of every entry's header, so it is done at start-up and again at most
    every `REFRESH_S` seconds, when a prompt finds no document.
    """

    REFRESH_S = 30.0

    def __init__(self, store: Any, fingerprint: str, model: str, where: str) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.model = model
        self.where = where
        self.ours = 0
        self.others: dict[str, int] = {}
        self.listed = False  # False: the store cannot list its entries
        self._at = -float("inf")

    def refresh(self, *, force: bool = False) -> None:
        """Count the store's entries by model (at most every `REFRESH_S` seconds)."""
        import time

        if not force and time.monotonic() - self._at < self.REFRESH_S:
            return
        self._at = time.monotonic()
        ours, others = 0, dict[str, int]()
        try:
            keys = self.store.keys()
        except Exception as error:  # noqa: BLE001 - a store that cannot list: nothing said
            logger.debug("the store cannot list its entries: %s", error)
            self.listed = False
            return
        for key in keys:
            try:
                metadata = self.store.metadata(key) or {}
            except Exception:  # noqa: BLE001 - an unreadable entry counts as nobody's
                continue
            if metadata.get("fingerprint") == self.fingerprint:
                ours += 1
            elif "fingerprint" in metadata:
                name = f"{metadata.get('model', '?')} ({metadata['fingerprint'][:12]})"
                others[name] = others.get(name, 0) + 1
        self.ours, self.others, self.listed = ours, others, True

    def describe(self) -> str:
        """Return the start-up line: the store's location and what it holds for this model."""
        self.refresh(force=True)
        identity = f"model {self.model} (fingerprint {self.fingerprint[:12]})"
        if not self.listed:
            return f"kvblend: store {self.where}, {identity}"
        line = f"kvblend: store {self.where}: {self.ours} entries of {identity}"
        if self.others:
            named = ", ".join(f"{count} of {name}" for name, count in sorted(self.others.items()))
            line += f"; other models' entries: {named}"
        return line

    def no_document_reason(self) -> RequestFallback:
        """Why a prompt finds no stored document: an empty store, another model's, or none."""
        self.refresh()
        if not self.listed:
            return NO_DOCUMENT
        if not self.ours and not self.others:
            words = (
                f"empty store: the store ({self.where}) holds no document; fill it with "
                "`kvblend precompute --model MODEL DOCUMENTS`"
            )
            return RequestFallback("empty_store", words)
        if not self.ours:
            total = sum(self.others.values())
            models = ", ".join(sorted(self.others))
            words = (
                f"other model: the store ({self.where}) holds {total} entries, none of this "
                f"model's (fingerprint {self.fingerprint[:12]}; they are of {models}): entries "
                "are keyed by the model's weights and dtype, precompute with the served folder "
                "and dtype"
            )
            return RequestFallback("other_model", words)
        words = (
            f"no stored document in the prompt: none of the {self.ours} entries of this model "
            "is a document found in the prompt (a document is found only where its exact text "
            "occurs)"
        )
        return RequestFallback(NO_DOCUMENT.code, words)
