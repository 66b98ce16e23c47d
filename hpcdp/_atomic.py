"""Writing a file without ever writing through a link someone planted: the one helper hpcdp uses.

Tools such as ``python -m hpcdp.trace merge DIR`` write into directories whose contents they do
not control. Opening a predictable name (``out.tmp``, ``phases.png``) for writing follows a
symbolic link placed there and overwrites whatever it points to. So every file hpcdp writes is
created under a fresh random name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (the kernel refuses any
existing entry, link or not, so a planted name can only make us pick another) and then renamed
onto the final name. ``rename`` replaces the directory entry itself: a link at the final name is
replaced, never followed.

- ``atomic_write``: the whole content at once; readers see the old file or the new one, never a
  torn one, and the temporary file is removed if the writer raises.
- ``open_new``: for a writer that streams into its final name for a long time (a timeline that a
  crash may cut short must still be on disk): the fresh file is renamed into place at once.
- ``open_append``: JSON lines added to a file several runs share; never follows a link at the
  name (an append cannot go through a rename without losing a concurrent writer's lines).

Standard library only: importable from any layer.
"""
from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import IO, Any, Iterator

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "open_new", "open_append",
           "fsync_dir"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
#: fresh names tried before giving up (a collision needs someone to guess 64 random bits)
_TRIES = 16


def _check_mode(mode: str) -> None:
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic write: mode must be 'w' or 'wb', got {mode!r}")


def _create_temp(path: str, perms: int) -> tuple[int, str]:
    """(fd, name) of a new empty file next to ``path``, under a name nobody could predict."""
    d, base = os.path.split(path)
    if not base:
        raise IsADirectoryError(errno.EISDIR, "no file name to write", path)
    last: OSError | None = None
    for _ in range(_TRIES):
        # base is shortened so that the temporary name stays under NAME_MAX (255)
        tmp = os.path.join(d, f".{base[:200]}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, _CREATE, perms), tmp
        except FileExistsError as exc:  # taken (or planted): another random name
            last = exc
    raise FileExistsError(errno.EEXIST, f"could not create a fresh temporary file next to it "
                                        f"in {_TRIES} tries", path) from last


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY | _CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "w", *, fsync: bool = False,
                 perms: int = 0o666, encoding: str = "utf-8") -> Iterator[IO[Any]]:
    """Yield a file object whose content replaces ``path`` when the block ends without error.

    Args:
        path: the final name; an existing file or link there is replaced (a link never followed).
        mode: ``"w"`` (text) or ``"wb"``.
        fsync: sync the file before the rename and the directory after it (crash-durable).
        perms: permission bits of the new file, before the umask.
        encoding: of text mode.
    """
    _check_mode(mode)
    path = os.fspath(path)
    fd, tmp = _create_temp(path, perms)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding})) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False,
                       perms: int = 0o666) -> None:
    """Replace ``path`` with ``data`` (see ``atomic_write``)."""
    with atomic_write(path, "wb", fsync=fsync, perms=perms) as fh:
        fh.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, *, fsync: bool = False,
                      perms: int = 0o666, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` (see ``atomic_write``)."""
    with atomic_write(path, "w", fsync=fsync, perms=perms, encoding=encoding) as fh:
        fh.write(text)


def open_new(path: str | os.PathLike[str], mode: str = "w", *, perms: int = 0o666,
             encoding: str = "utf-8") -> IO[Any]:
    """A new empty file at ``path``, returned open for writing (the caller closes it).

    Created under a fresh name and renamed onto ``path`` before anything is written, so a link
    at ``path`` is replaced, and what is written later is on disk under ``path`` even if the
    process dies before closing it.
    """
    _check_mode(mode)
    path = os.fspath(path)
    fd, tmp = _create_temp(path, perms)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))


def open_append(path: str | os.PathLike[str], *, perms: int = 0o666, encoding: str = "utf-8") -> IO[str]:
    """``path`` opened to append text: an existing regular file, or a new one created exclusively.

    Never through a symbolic link (``O_NOFOLLOW``: a link at ``path`` raises ``OSError`` naming
    it) and never into a FIFO or device. Appending goes to the file in place, not through a
    rename, so that several runs appending to one file all keep their lines.
    """
    path = os.fspath(path)
    flags = os.O_WRONLY | os.O_APPEND | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, perms)
    except FileExistsError:
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP or os.path.islink(path):
                raise OSError(errno.ELOOP, "is a symbolic link: refusing to append through it", path) from exc
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "is not a regular file: refusing to append to it", path)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "a", encoding=encoding)
    except BaseException:
        os.close(fd)
        raise
