"""A store folder made read-only the way deployments do: a read-only bind mount for root (whom
file modes do not stop), file modes for anyone else."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def read_only_folder(folder: Path) -> Iterator[Path]:
    """`folder`, made read-only: by permissions for a user, a read-only bind mount for root."""
    if os.geteuid() != 0:
        paths = [folder, *folder.rglob("*")]
        for path in paths:
            path.chmod(0o500 if path.is_dir() else 0o400)
        try:
            yield folder
        finally:
            for path in paths:
                path.chmod(0o700 if path.is_dir() else 0o600)
        return
    view = folder.parent / "read-only-view"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(folder), str(view)], check=False)
    if mounted.returncode != 0:
        pytest.skip("root without mount: a read-only folder cannot be made here")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        yield view
    finally:
        subprocess.run(["umount", "--lazy", str(view)], check=False)  # open handles: detach now
