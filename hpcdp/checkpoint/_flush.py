"""Write-back while a save goes on: fsync in a helper thread.

Without it the device starts writing a checkpoint's bytes only at the final fsync, and the core
that copied them into the page cache then idles until they are all out. A ``Flusher`` fsyncs the
files written so far in a helper thread (fsync releases the GIL) whenever enough new bytes were
written, so the device writes earlier slabs while later ones are still being copied, and the
slab checksums and the metadata are computed while the last ones go out. It changes no
guarantee: the save still fsyncs every file itself after the last write, and commits after that.

A write-back error is reported by the kernel to one fsync only, so the first error a helper
fsync met is kept and returned by ``wait``: the caller must fail the save with it.
"""
from __future__ import annotations

import threading

from . import _commit

__all__ = ["Flusher", "FLUSH_EVERY_BYTES"]

#: a file is fsynced early once at least this many new bytes were written to it
FLUSH_EVERY_BYTES = 32 << 20


class Flusher:
    """fsync of files in one helper thread, as their bytes are written (see the module doc)."""

    def __init__(self, every: int | None = None) -> None:
        self.every = FLUSH_EVERY_BYTES if every is None else every
        self._cv = threading.Condition()
        self._pending: set[str] = set()
        self._unflushed: dict[str, int] = {}
        self._closing = False
        self._exc: BaseException | None = None
        self._thread: threading.Thread | None = None

    def wrote(self, path: str, nbytes: int) -> None:
        """``nbytes`` more were written to ``path``: fsync it soon once enough are waiting."""
        n = self._unflushed.get(path, 0) + nbytes
        self._unflushed[path] = n
        if n >= self.every:
            self.flush([path])

    def flush(self, paths: list[str]) -> None:
        """fsync ``paths`` in the helper thread (after any fsync it is running now)."""
        if not paths:
            return
        with self._cv:
            if self._closing:
                raise RuntimeError("Flusher.flush after wait")
            for p in paths:
                self._unflushed[p] = 0
                self._pending.add(p)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hpcdp-ckpt-fsync",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                todo, self._pending = sorted(self._pending), set()
            if not todo:
                return  # closing, nothing left
            for p in todo:
                if self._exc is None:
                    try:
                        _commit.fsync_path(p)
                    except BaseException as exc:  # noqa: BLE001 - handed to wait()
                        self._exc = exc

    def wait(self) -> BaseException | None:
        """Let the helper finish every fsync asked for, then stop it; the first error it met.
        Safe to call again."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self._exc
