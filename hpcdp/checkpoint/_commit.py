"""Atomic commit of a checkpoint directory, ``latest``, rotation and clean-up.

A checkpoint ``ckpt/step-100`` is the directory ``ckpt/step-100/`` holding ``data.h5`` (and, in
VDS mode, the per-rank files it maps). It is written as ``ckpt/.tmp-step-100-<token>/``, every file
fsynced, verified, then renamed into place and ``ckpt/`` fsynced: the rename is the commit, so a
directory under a name without the ``.tmp-`` prefix is always complete. Leftover ``.tmp-*``
directories (a crash mid-save) are removed by the next save into the same parent directory.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil

__all__ = ["DATA", "TMP_PREFIX", "begin", "commit", "fsync_path", "list_checkpoints", "latest",
           "rotate", "cleanup_uncommitted", "discard"]

DATA = "data.h5"
TMP_PREFIX = ".tmp-"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cleanup_uncommitted(parent: str) -> list[str]:
    """Remove the ``.tmp-*`` leftovers of saves that never committed; their names."""
    removed = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed


def begin(final: str) -> str:
    """Create and return the temporary directory a save into ``final`` writes to."""
    parent, base = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    cleanup_uncommitted(parent)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{base}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    return tmp


def discard(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: str, final: str) -> None:
    """fsync ``tmp`` (the files in it are already synced), rename it to ``final``, fsync the parent."""
    parent, base = os.path.split(final)
    fsync_path(tmp)
    old = None
    if os.path.lexists(final):
        # Re-saving under an existing name: move the old one aside first (rename cannot replace a
        # non-empty directory); it is deleted only once the new one is in place.
        old = os.path.join(parent, f"{TMP_PREFIX}old-{base}-{secrets.token_hex(4)}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _natural_key(name: str) -> tuple:
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t)


def list_checkpoints(directory: str) -> list[str]:
    """Committed checkpoints in ``directory``, oldest first (natural order of names: step-9 < step-10)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        full = os.path.join(directory, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(full, DATA)):
            continue
        found.append((_natural_key(name), os.path.getmtime(os.path.join(full, DATA)), full))
    return [p for _, _, p in sorted(found)]


def latest(directory: str) -> str | None:
    """The newest committed checkpoint in ``directory`` (largest step in its name), or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def rotate(directory: str, keep_last: int, protect: str) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints (never ``protect``); what was deleted."""
    found = [p for p in list_checkpoints(directory) if os.path.abspath(p) != os.path.abspath(protect)]
    doomed = found[: max(0, len(found) - (keep_last - 1))]
    for p in doomed:
        # Rename first so that a crash mid-delete never leaves a torn checkpoint under a real name.
        tomb = os.path.join(directory, f"{TMP_PREFIX}del-{os.path.basename(p)}-{secrets.token_hex(4)}")
        os.rename(p, tomb)
        shutil.rmtree(tomb, ignore_errors=True)
    return doomed
