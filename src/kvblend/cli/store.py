"""The ``kvblend store`` commands: stats, clear and repair of an on-disk KV store folder.

They open the folder only, never a model, and report every problem as one line with exit
status 2 (through the command line's `CLIError`): a folder that does not exist, is not a KV
store, or cannot be used. A damaged index is set aside and rebuilt when the folder is opened,
so these commands work on the folders that need them most.

Hit and miss counters are kept per process by the store object that serves lookups; a fresh
process has none, so ``stats`` shows what the folder holds, not a hit rate (which would always
read 0%). A service reads its own hit rate from ``engine.store.stats()``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvblend.command_line import CLIError

if TYPE_CHECKING:  # the store (and torch) load only when a store command runs
    from kvblend.store import DiskKVStore, RepairReport


def add_store_parser(sub: Any) -> None:  # noqa: ANN401 - argparse's private subparsers action
    """Add the ``store`` command to the ``kvblend`` subcommands `sub`."""
    store = sub.add_parser("store", help="show, clear or repair the on-disk KV store")
    store.add_argument(
        "action",
        choices=["stats", "clear", "repair"],
        help="stats: what the folder holds; clear: delete every entry; repair: set a damaged "
        "index aside and rebuild it from the entry files, drop index rows without a valid file, "
        "take whole entry files no row names back into the index, delete the partial or "
        "unusable ones, and read every indexed entry whole (size, header, checksums), deleting "
        "the damaged ones",
    )
    store.add_argument("--store-dir", help="KV store folder (default: user cache dir)")
    store.add_argument(
        "--other-keys",
        action="store_true",
        help="with clear: delete only the entries this process cannot verify, those signed with "
        "another store key than $KVBLEND_STORE_KEY or with none (needs the key)",
    )
    store.set_defaults(func=cmd_store)


def _user_error(message: str) -> Exception:
    return CLIError(message)  # the command line's one-line error, exit status 2


def _check_folder(directory: Path, action: str) -> bool:
    """Return False if there is no folder (nothing to do); raise for a folder that is no store."""
    from kvblend.store.files import INDEX_NAME

    if not directory.exists():
        if action == "clear":
            return False
        raise _user_error(f"no KV store at {directory} (nothing precomputed there yet?)")
    if not directory.is_dir():
        raise _user_error(f"{directory} is not a folder")
    if not (directory / INDEX_NAME).exists() and any(directory.iterdir()):
        raise _user_error(f"{directory} is not a KV store folder (it has no {INDEX_NAME})")
    return True


def cmd_store(args: argparse.Namespace) -> None:
    """Show, clear or repair the on-disk store."""
    from kvblend.store import DiskKVStore, StoreError, default_store_dir

    directory = Path(args.store_dir).expanduser() if args.store_dir else default_store_dir()
    if args.other_keys and args.action != "clear":
        raise _user_error("--other-keys goes with clear")
    try:
        if not _check_folder(directory, args.action):
            print(f"no KV store at {directory}: nothing to clear")
            return
        store = DiskKVStore(directory)
        try:
            if args.action == "clear" and args.other_keys:
                dropped = store.clear_other_keys()
                print(
                    f"cleared {dropped} entries of another store key (or none) from {directory}; "
                    f"{store.stats().entries} entries left"
                )
            elif args.action == "clear":
                before = store.stats().entries
                store.clear()
                print(f"cleared {before} entries from {directory}")
            elif args.action == "repair":
                _print_repair(directory, store)
            else:
                _print_stats(directory, store)
        finally:
            store.close()
    except (StoreError, OSError, ValueError) as error:  # ValueError: a bad setting
        raise _user_error(str(error)) from error


def _print_stats(directory: Path, store: DiskKVStore) -> None:
    from kvblend.store import StoreError
    from kvblend.store.index import DAMAGED_NAME

    stats = store.stats()
    print(f"store folder: {directory}")
    print(f"entries: {stats.entries}")
    print(f"bytes: {stats.bytes:,} ({stats.bytes / 2**20:.1f} MiB)")
    print(f"access: {'shared with the group' if store.modes.shared else 'private to the owner'}")
    if stats.read_only:
        print("read-only: entries are read, nothing is written (the folder cannot be written)")
    if (directory / DAMAGED_NAME).exists():
        print(f"a damaged index was set aside as {directory / DAMAGED_NAME} (safe to delete)")
    redis_url = os.environ.get("KVBLEND_REDIS_URL")
    if redis_url:  # the shared tier: shown, never cleared or repaired from here
        from kvblend.store import RedisKVStore

        remote = RedisKVStore(redis_url)
        print(f"redis: {remote.url}")
        try:
            remote_stats = remote.stats()
        except StoreError as error:
            print(f"redis tier unavailable: {error}")
        else:
            print(f"redis entries: {remote_stats.entries}")
            print(f"redis bytes: {remote_stats.bytes:,} ({remote_stats.bytes / 2**20:.1f} MiB)")


def _print_repair(directory: Path, store: DiskKVStore) -> None:
    from kvblend.store.index import DAMAGED_NAME

    report = store.repair()
    print(f"store folder: {directory}")
    if report.read_only:
        _print_survey(report)
        return
    if report.index_set_aside:
        print(f"index: set aside as {DAMAGED_NAME} and rebuilt")
    else:
        print("index: missing or empty, rebuilt" if report.index_rebuilt else "index: ok")
    print(f"index rows without a valid file dropped: {report.rows_dropped}")
    print(f"entry files taken back into the index: {report.files_adopted}")
    print(
        f"unusable files deleted (partial, damaged or duplicate): {report.orphans_deleted} "
        f"({report.orphan_bytes:,} bytes)"
    )
    print(
        f"indexed entries read whole (size, header, checksums): {report.entries_checked}; "
        f"damaged ones deleted: {report.entries_damaged} ({report.damaged_bytes:,} bytes)"
    )
    if report.other_key_entries:
        print(_other_keys_line(report))
    print(f"entries: {report.entries}, bytes: {report.bytes:,}")


def _other_keys_line(report: RepairReport) -> str:
    return (
        f"entries of another store key (or none), kept: {report.other_key_entries} "
        "(`kvblend store clear --other-keys` deletes them)"
    )


def _print_survey(report: RepairReport) -> None:
    """Print what `repair` found in a folder it cannot change."""
    print("read-only: nothing was changed (the folder cannot be written)")
    print(f"index: {'damaged, left as it is' if report.index_damaged else 'ok'}")
    print(f"index rows without a valid file: {report.rows_broken}")
    print(f"value files no index row names: {report.files_unindexed}")
    print(
        f"indexed entries read whole (size, header, checksums): {report.entries_checked}; "
        f"failing a check, left: {report.entries_damaged} ({report.damaged_bytes:,} bytes)"
    )
    if report.other_key_entries:
        print(_other_keys_line(report))
    print(f"entries: {report.entries}, bytes: {report.bytes:,}")
    healthy = not (
        report.index_damaged
        or report.rows_broken
        or report.files_unindexed
        or report.entries_damaged
    )
    print("healthy" if healthy else "run repair where the folder can be written to fix these")
