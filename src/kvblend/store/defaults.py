"""`default_store()`: the store an engine builds when it is given none.

Memory in front of disk (`TieredKVStore`), then Redis (`RemoteTieredKVStore`) when a URL is
set. This module sits above every tier in the package's import graph, so that no tier imports
another that imports it back.
"""

from __future__ import annotations

import logging
import os

import torch

from kvblend.store.base import StoreError
from kvblend.store.disk import DEFAULT_DISK_BYTES, DiskKVStore
from kvblend.store.memory import DEFAULT_MEMORY_BYTES, MemoryKVStore
from kvblend.store.remote_tier import RemoteTieredKVStore
from kvblend.store.tiered import DEFAULT_DISK_RETRY_S, TieredKVStore

logger = logging.getLogger(__name__)


def default_store(
    directory: str | os.PathLike[str] | None = None,
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    disk_bytes: int = DEFAULT_DISK_BYTES,
    device: torch.device | str | None = None,
    shared: bool | None = None,
    disk_retry_s: float = DEFAULT_DISK_RETRY_S,
    redis_url: str | None = None,
    redis_ttl_s: float | None = None,
    disk_required: bool = False,
) -> TieredKVStore:
    """Build the default store: 2 GiB in memory in front of 20 GiB on disk, then Redis if set.

    The disk folder is `directory`, else `$KVBLEND_STORE_DIR`, else the user cache folder (see
    `default_store_dir`); it is private unless `shared` (see `DiskKVStore`). `device` places
    the memory tier (e.g. "cuda"). If the folder cannot be opened (read-only, not a folder), a
    warning is logged, the store works from memory, and the folder is tried again every
    `disk_retry_s` seconds; with `disk_required` (a command whose whole point is to keep what
    it computes, such as ``kvblend precompute``) it raises that `StoreError` instead. With
    `redis_url`, else `$KVBLEND_REDIS_URL`, a `RedisKVStore`
    (entries expiring after `redis_ttl_s`, if given) becomes a third, shared tier
    (`RemoteTieredKVStore`).
    """
    memory = MemoryKVStore(memory_bytes, device=device)

    def open_disk() -> DiskKVStore:
        return DiskKVStore(directory, size_limit=disk_bytes, shared=shared)

    try:
        disk: DiskKVStore | None = open_disk()
    except StoreError as error:
        if disk_required:
            raise
        logger.warning(
            "KV store disk tier unavailable, using memory only and trying again every %g s: %s",
            disk_retry_s,
            error,
        )
        disk = None
    redis_url = redis_url or os.environ.get("KVBLEND_REDIS_URL")
    if redis_url:
        from kvblend.store.redis import RedisKVStore  # needs the redis package: on use only

        remote = RedisKVStore(redis_url, ttl_s=redis_ttl_s)
        return RemoteTieredKVStore(
            memory, disk, remote=remote, open_disk=open_disk, disk_retry_s=disk_retry_s
        )
    return TieredKVStore(memory, disk, open_disk=open_disk, disk_retry_s=disk_retry_s)
