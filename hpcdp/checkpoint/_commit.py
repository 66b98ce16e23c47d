"""Atomic commit of a checkpoint directory, ``latest``, rotation and clean-up.

A checkpoint ``ckpt/step-100`` is the directory ``ckpt/step-100/`` holding ``data.h5`` (and, in
VDS mode, the per-rank files it maps). It is written as ``ckpt/.tmp-step-100-<token>/``, every file
fsynced, verified, then renamed into place and ``ckpt/`` fsynced: the rename is the commit, so a
directory under a name without the ``.tmp-`` prefix is always complete.

Names under the ``.tmp-`` prefix (``<token>`` is 8 hex digits):
- ``.tmp-<name>-<token>``: a save in progress, or the leftover of one that died;
- ``.tmp-<name>-<token>.old``: a committed checkpoint moved aside while a re-save of the same name
  renames its new directory into place; if ``<name>`` is missing the re-save died between the two
  renames, and this is the last good copy: clean-up renames it back, never deletes it;
- ``.tmp-<name>-<token>.del``: a checkpoint being deleted by rotation.
Clean-up (at the start of every save, rank 0) removes leftovers of the same name, which no live
save can own (saves of one name run one at a time), and others only once untouched for
``STALE_AFTER_S``: another job may be saving into the same directory right now, and its directory
is in use as long as its files keep changing.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import time

__all__ = ["DATA", "TMP_PREFIX", "STALE_AFTER_S", "begin", "commit", "fsync_path", "list_checkpoints",
           "latest", "rotate", "cleanup_uncommitted", "discard"]

DATA = "data.h5"
TMP_PREFIX = ".tmp-"
#: a temporary directory of another name unchanged for this long belongs to a save that died
STALE_AFTER_S = 30 * 60.0
_TMP_RE = re.compile(r"^\.tmp-(?P<name>.+)-[0-9a-f]{8}(?P<kind>\.old|\.del)?$")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name(base: str, kind: str = "") -> str:
    return f"{TMP_PREFIX}{base}-{secrets.token_hex(4)}{kind}"


def _last_change(path: str) -> float:
    """Newest mtime of ``path`` and of the entries in it (a save writing its files bumps theirs)."""
    newest = os.lstat(path).st_mtime
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
                except OSError:
                    pass
    except (NotADirectoryError, OSError):
        pass
    return newest


def cleanup_uncommitted(parent: str, name: str | None = None, *, now: float | None = None) -> list[str]:
    """Tidy the ``.tmp-*`` leftovers in ``parent``; the names removed or restored.

    A moved-aside checkpoint (``.old``) whose name is free is renamed back. Other leftovers are
    removed if they belong to ``name`` (the checkpoint about to be saved) or are rotation tombs,
    and otherwise only once stale, so a concurrent save's directory is never taken from under it.
    """
    done: list[str] = []
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return done
    now = time.time() if now is None else now
    for entry in entries:
        if not entry.startswith(TMP_PREFIX):
            continue
        full = os.path.join(parent, entry)
        m = _TMP_RE.match(entry)
        try:
            if m and m["kind"] == ".old":
                target = os.path.join(parent, m["name"])
                if not os.path.lexists(target):
                    os.rename(full, target)   # the last good copy goes back under its name
                    done.append(entry)
                    continue
                if m["name"] != name and now - _last_change(full) < STALE_AFTER_S:
                    continue                  # a re-save of that name may be committing right now
            elif not ((m and (m["kind"] == ".del" or m["name"] == name))
                      or now - _last_change(full) >= STALE_AFTER_S):
                continue
        except OSError:
            continue                          # vanished or raced: another save is tidying it
        shutil.rmtree(full, ignore_errors=True)
        done.append(entry)
    return done


def begin(final: str) -> str:
    """Create and return the temporary directory a save into ``final`` writes to."""
    parent, base = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    cleanup_uncommitted(parent, base)
    tmp = os.path.join(parent, _tmp_name(base))
    os.mkdir(tmp)
    return tmp


def discard(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: str, final: str) -> None:
    """fsync ``tmp`` (the files in it are already synced), rename it to ``final``, fsync the parent.

    Re-saving under an existing name moves the old directory aside first (rename cannot replace a
    non-empty directory): if the second rename fails it is moved back; if the process dies between
    the two, the next save's clean-up moves it back. It is deleted only once the new one is in place.
    """
    parent, base = os.path.split(final)
    fsync_path(tmp)
    old = None
    if os.path.lexists(final):
        old = os.path.join(parent, _tmp_name(base, ".old"))
        os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        if old is not None:
            try:
                os.rename(old, final)
            except OSError:
                pass  # left as .old: cleanup_uncommitted restores it
        raise
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
        tomb = os.path.join(directory, _tmp_name(os.path.basename(p), ".del"))
        os.rename(p, tomb)
        shutil.rmtree(tomb, ignore_errors=True)
    return doomed
