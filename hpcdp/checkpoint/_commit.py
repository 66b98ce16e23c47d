"""Atomic commit of a checkpoint directory, ``latest``, rotation, recovery and clean-up.

A checkpoint ``ckpt/step-100`` is the directory ``ckpt/step-100/`` holding ``data.h5`` (and, in
VDS mode, the per-rank files it maps). It is written as ``ckpt/.tmp-step-100-<token>/``, every file
fsynced, verified, then renamed into place and ``ckpt/`` fsynced: the rename is the commit, so a
directory under a name without the ``.tmp-`` prefix is always complete.

hpcdp deletes or replaces only what it wrote. A *committed checkpoint* is a real directory (not a
link) whose ``data.h5`` carries the format marker and a valid manifest, recognised by content,
never by a file name; ``list_checkpoints``, ``latest`` and rotation see nothing else. ``save``
replaces an existing path, and rotation deletes one, only if it is a committed checkpoint holding
nothing but its own files (``data.h5`` and the rank files its manifest lists): a project
directory, the parent of ``step-*/`` or a checkpoint a user added notes to is left as it is.

Names under the ``.tmp-`` prefix (``<token>`` is 8 hex digits):
- ``.tmp-<name>-<token>``: a save in progress, or the leftover of one that died;
- ``.tmp-<name>-<token>.old``: a committed checkpoint moved aside while a re-save of the same name
  renames its new directory into place; if ``<name>`` is missing the re-save died between the two
  renames, and this is the last good copy: ``latest``, ``load`` and the next save's clean-up
  rename it back (``recover``), never delete it;
- ``.tmp-<name>-<token>.del``: a checkpoint being deleted by rotation.
Clean-up (at the start of every save, rank 0) removes leftovers of the same name, which no live
save can own (saves of one name run one at a time), and others only once untouched for
``STALE_AFTER_S``: another job may be saving into the same directory right now. It removes only
names of exactly that form holding only hpcdp's file names, so a user's ``.tmp-build/`` stays.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import time

import h5py

from ..errors import CheckpointError
from ._layout import read_manifest
from ._manifest import RANK_FILE_RE

__all__ = ["DATA", "TMP_PREFIX", "STALE_AFTER_S", "begin", "commit", "fsync_path", "list_checkpoints",
           "latest", "rotate", "cleanup_uncommitted", "discard", "inspect", "replace_problem",
           "recover", "restore_moved_aside"]

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


# -- what hpcdp wrote -----------------------------------------------------------------------
def inspect(path: str) -> tuple[set[str] | None, str]:
    """(the entries a committed checkpoint at ``path`` consists of, "") or (None, why it is not one)."""
    try:
        return _inspect(path)
    except OSError as exc:  # vanished or unreadable while we looked
        return None, f"it cannot be listed ({exc})"


def _inspect(path: str) -> tuple[set[str] | None, str]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, "it does not exist"
    if stat.S_ISLNK(st.st_mode):
        return None, "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return None, "it is not a directory"
    fn = os.path.join(path, DATA)
    try:
        if not stat.S_ISREG(os.lstat(fn).st_mode):
            return None, f"its {DATA} is not a regular file"
    except FileNotFoundError:
        return None, f"it holds no {DATA}" if os.listdir(path) else "it is an empty directory"
    try:
        with h5py.File(fn, "r") as f:
            m = read_manifest(f, fn)
    except CheckpointError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - anything unreadable is not a committed checkpoint
        return None, f"{fn} cannot be read as HDF5 ({type(exc).__name__}: {exc})"
    return {DATA, *m["files"]}, ""


def _foreign(path: str, ours: set[str]) -> list[str]:
    """Entries of ``path`` that are not one of ``ours`` as a regular file."""
    out = []
    for name in sorted(os.listdir(path)):
        if name not in ours or not stat.S_ISREG(os.lstat(os.path.join(path, name)).st_mode):
            out.append(name)
    return out


def replace_problem(path: str) -> str | None:
    """None if hpcdp may replace or delete ``path`` (a committed checkpoint, nothing else in it);
    otherwise why not."""
    try:
        ours, why = inspect(path)
        if ours is None:
            return why
        extra = _foreign(path, ours)
    except OSError as exc:  # vanished or unreadable while we looked
        return f"it cannot be listed ({exc})"
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        return f"it holds {shown} besides the checkpoint's own files"
    return None


def _only_our_files(path: str) -> bool:
    """A real directory holding nothing but files named as hpcdp names its files."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        with os.scandir(path) as it:
            return all(e.is_file(follow_symlinks=False) and (e.name == DATA or RANK_FILE_RE.fullmatch(e.name))
                       for e in it)
    except OSError:
        return False


# -- recovery and clean-up ------------------------------------------------------------------
def restore_moved_aside(parent: str, name: str | None = None) -> list[str]:
    """Put moved-aside checkpoints (``.old``) whose name is free back under it; what was restored.

    Only committed checkpoints with nothing else in them are restored. Safe to run on many ranks
    or processes at once: one rename wins, the others find the name taken or the source gone.
    """
    try:
        entries = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    best: dict[str, tuple[float, str]] = {}
    for entry in entries:
        m = _TMP_RE.match(entry)
        if not m or m["kind"] != ".old" or (name is not None and m["name"] != name):
            continue
        full = os.path.join(parent, entry)
        if os.path.lexists(os.path.join(parent, m["name"])) or replace_problem(full) is not None:
            continue
        try:
            when = os.lstat(os.path.join(full, DATA)).st_mtime
        except OSError:
            continue
        if m["name"] not in best or (when, entry) > best[m["name"]]:
            best[m["name"]] = (when, entry)
    done = []
    for target, (_, entry) in best.items():
        try:
            os.rename(os.path.join(parent, entry), os.path.join(parent, target))
        except OSError:
            continue  # another rank or process restored it first, or the name was just taken
        done.append(entry)
    if done:
        try:
            fsync_path(parent)
        except OSError:
            pass
    return done


def recover(path: str) -> bool:
    """If checkpoint ``path`` (or its ``data.h5``) is missing because a re-save died between its
    two renames, put the previous copy back; whether this call did."""
    p = os.path.abspath(path).rstrip(os.sep)
    if os.path.basename(p) == DATA and not os.path.lexists(os.path.dirname(p)):
        p = os.path.dirname(p)
    if os.path.lexists(p):
        return False
    parent, base = os.path.split(p)
    return bool(restore_moved_aside(parent, base))


def cleanup_uncommitted(parent: str, name: str | None = None, *, now: float | None = None) -> list[str]:
    """Tidy the ``.tmp-*`` leftovers in ``parent``; the names removed or restored.

    A moved-aside checkpoint (``.old``) whose name is free is renamed back. Other leftovers are
    removed if they belong to ``name`` (the checkpoint about to be saved) or are rotation tombs,
    and otherwise only once stale, so a concurrent save's directory is never taken from under it.
    """
    done = restore_moved_aside(parent)
    try:
        entries = os.listdir(parent)
    except FileNotFoundError:
        return done
    now = time.time() if now is None else now
    for entry in entries:
        m = _TMP_RE.match(entry)
        full = os.path.join(parent, entry)
        if not m or not _only_our_files(full):
            continue                          # not a name, or not contents, that hpcdp makes
        try:
            mine = m["kind"] == ".del" or m["name"] == name
            if m["kind"] == ".old" and m["name"] != name:
                mine = False                  # a re-save of that name may be committing right now
            if not mine and now - _last_change(full) < STALE_AFTER_S:
                continue
        except OSError:
            continue                          # vanished or raced: another save is tidying it
        shutil.rmtree(full, ignore_errors=True)
        done.append(entry)
    return done


# -- save's side ----------------------------------------------------------------------------
def _refuse(final: str) -> None:
    why = replace_problem(final)
    if why is not None:
        raise CheckpointError(f"{final} exists and is not a committed hpcdp checkpoint ({why}); "
                              "hpcdp replaces only checkpoints it wrote: choose another path or "
                              "move it away")


def begin(final: str) -> str:
    """Create and return the temporary directory a save into ``final`` writes to.

    Raises ``CheckpointError``, having touched nothing, if ``final`` exists and is not a committed
    checkpoint that may be replaced.
    """
    parent, base = os.path.split(final)
    if not base:
        raise CheckpointError(f"{final!r} names no directory to save into")
    if os.path.lexists(final):
        _refuse(final)
    os.makedirs(parent, exist_ok=True)
    cleanup_uncommitted(parent, base)
    return _fresh_dir(parent, base)


def _fresh_dir(parent: str, base: str) -> str:
    """mkdir a new ``.tmp-<base>-<random token>``: created exclusively (a name that exists, a link
    included, is never reused or followed), under a name nobody can predict."""
    for _ in range(16):
        tmp = os.path.join(parent, _tmp_name(base))
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue
    raise CheckpointError(f"save {os.path.join(parent, base)!r}: could not create a fresh temporary "
                          f"directory in {parent!r} in 16 tries")


def discard(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: str, final: str) -> None:
    """fsync ``tmp`` (the files in it are already synced), rename it to ``final``, fsync the parent.

    Re-saving under an existing name moves the old directory aside first (rename cannot replace a
    non-empty directory): if the second rename fails it is moved back; if the process dies between
    the two, ``latest``, ``load`` or the next save moves it back. It is deleted only once the new
    one is in place. If a reader moved it back in between (``recover``), this starts over.
    """
    parent, base = os.path.split(final)
    fsync_path(tmp)
    for attempt in range(3):
        old = None
        if os.path.lexists(final):
            _refuse(final)  # checked again: something may have been put there while we wrote
            old = os.path.join(parent, _tmp_name(base, ".old"))
            os.rename(final, old)
        try:
            os.rename(tmp, final)
            break
        except BaseException as exc:
            if old is not None:
                try:
                    os.rename(old, final)
                except OSError:
                    pass  # left as .old: recover() restores it
            retry = isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST)
            if not retry or attempt == 2:
                raise
    fsync_path(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- listing and rotation -------------------------------------------------------------------
def _natural_key(name: str) -> tuple:
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name) if t)


def _candidates(directory: str) -> list[tuple[tuple, float, str]]:
    """Real sub-directories that may be checkpoints, oldest first by name (then mtime)."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        full = os.path.join(directory, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if name.startswith(".") or not stat.S_ISDIR(st.st_mode):
            continue
        found.append((_natural_key(name), st.st_mtime, full))
    return sorted(found)


def list_checkpoints(directory: str) -> list[str]:
    """Committed checkpoints in ``directory``, oldest first (natural order of names: step-9 < step-10)."""
    return [p for _, _, p in _candidates(directory) if inspect(p)[0] is not None]


def latest(directory: str) -> str | None:
    """The newest committed checkpoint in ``directory`` (largest step in its name), or None.

    A re-save that died between its two renames is recovered first (the previous copy is put back).
    """
    restore_moved_aside(directory)
    for _, _, p in reversed(_candidates(directory)):
        if inspect(p)[0] is not None:
            return p
    return None


def rotate(directory: str, keep_last: int, protect: str) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints (never ``protect``); what was deleted.

    A checkpoint holding files hpcdp did not write is kept, and named in the error raised at the end.
    """
    found = [p for p in list_checkpoints(directory) if os.path.abspath(p) != os.path.abspath(protect)]
    doomed = found[: max(0, len(found) - (keep_last - 1))]
    deleted, kept = [], []
    for p in doomed:
        why = replace_problem(p)
        if why is not None:
            kept.append(f"{os.path.basename(p)} ({why})")
            continue
        # Rename first so that a crash mid-delete never leaves a torn checkpoint under a real name.
        tomb = os.path.join(directory, _tmp_name(os.path.basename(p), ".del"))
        os.rename(p, tomb)
        shutil.rmtree(tomb, ignore_errors=True)
        deleted.append(p)
    if kept:
        raise CheckpointError(f"rotation kept {'; '.join(kept)}: hpcdp deletes only what it wrote")
    return deleted
