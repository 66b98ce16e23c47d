"""libnbc's Iallreduce algorithm, chosen per call by message size through MPI_T.

hpcdp's allreduce is an ``Iallreduce`` polled against a deadline (see ``_backend``). Open MPI 4's
libnbc picks binomial for 2-3 ranks whatever the size, which is slower than the blocking
``MPI_Allreduce`` from a few KiB up (about 1.3-1.5x its time at 1-4 MiB on 2 ranks), where its
ring beats ``MPI_Allreduce``; below a few KiB ring costs microseconds more than binomial. So
ring from ``RING_MIN_BYTES`` up, libnbc's own choice below (``post``). The choice is a process-wide MPI_T
control variable (``coll_libnbc_iallreduce_algorithm``) that libnbc reads when a call is posted:
set-and-post runs under one lock, so two threads posting at once cannot give one call the other's
algorithm, and every rank decides from the size alone, so all ranks of a call agree (libnbc
requires that). The variable is ring only while a ring call is posted, default otherwise: MPI's
own nonblocking allreduces read it too (the context-id agreement inside ``Comm_split`` and
``Comm_dup``), and left at the last call's value it differed between ranks whenever one rank
skipped a call its peers posted (told that a peer left): the next ``new_group`` hung.
It is written through MPI_T, after ``MPI_Init``, so it holds whether the script
imported mpi4py before hpcdp or not (the ``OMPI_MCA_`` environment is read only at ``MPI_Init``,
which cost a fifth to a quarter of ``Allreduce``'s bandwidth in mpi4py-first scripts).

A user's own choice wins: with ``OMPI_MCA_coll_libnbc_iallreduce_algorithm`` set, or the variable
not at its default (0) when hpcdp starts, hpcdp leaves it alone; so does an MPI without it.
"""
from __future__ import annotations

import _thread
import ctypes
import os
import threading
from typing import Any

__all__ = ["Tuner", "tuner", "release", "post", "RING_MIN_BYTES"]

RING_MIN_BYTES = 8 << 10
_DEFAULT, _RING = 0, 1
_CVAR = b"coll_libnbc_iallreduce_algorithm"
_THREAD_MULTIPLE = 3  # MPI_THREAD_MULTIPLE in Open MPI's mpi.h

_tuner: "Tuner | None" = None
_probed = False
#: Threads started through ``_thread`` (every ``threading.Thread``), the main thread excluded.
_other_threads = _thread._count


class Tuner:
    """The algorithm variable and the lock every Iallreduce posting holds while it reads it.

    Posting, with ``lock`` held: a ring-sized call ``set(1)``, posts, ``set(0)``; any other call
    ``set(0)`` if ``current`` is not 0 (a failed reset), then posts. A small call from a process
    with no thread but the main one (``_thread._count() == 0``) and ``current`` 0 posts without
    the lock: no other thread exists to be between a set and its post.
    """

    def __init__(self, lib: Any, handle: ctypes.c_void_p) -> None:
        self.lock = threading.Lock()
        self.current = _DEFAULT
        self._lib, self._handle = lib, handle
        self._write = lib.MPI_T_cvar_write
        self._write.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._write.restype = ctypes.c_int
        self._values = {v: ctypes.c_int(v) for v in (_DEFAULT, _RING)}

    def set(self, value: int) -> None:
        """Call with ``lock`` held."""
        if self._write(self._handle, ctypes.byref(self._values[value])) == 0:
            self.current = value

    def close(self) -> None:
        with self.lock:
            if self.current != _DEFAULT:
                self.set(_DEFAULT)
            self._lib.MPI_T_cvar_handle_free(ctypes.byref(self._handle))
            self._lib.MPI_T_finalize()


def post(nb: Tuner | None, comm: Any, s: Any, r: Any, mop: Any, nbytes: int) -> Any:
    """``comm.Iallreduce(s, r, mop)`` with the algorithm for ``nbytes`` (``nb``: the tuner)."""
    ring = nbytes >= RING_MIN_BYTES
    if nb is None or not (ring or nb.current or _other_threads()):
        # Untuned, or a small call from the only thread, with the variable at its default:
        # no thread can be between a set and its post (the lock is a measurable share here).
        return comm.Iallreduce(s, r, mop)
    nb.lock.acquire()  # the algorithm libnbc reads while posting
    try:
        if ring:
            nb.set(_RING)  # for this post only: back to the default right after it
        elif nb.current:
            nb.set(_DEFAULT)
        return comm.Iallreduce(s, r, mop)
    finally:
        if ring:
            nb.set(_DEFAULT)
        nb.lock.release()


def tuner() -> Tuner | None:
    """The process's tuner once MPI is initialised; None where hpcdp must leave libnbc alone."""
    global _tuner, _probed
    if not _probed:
        _probed = True
        if "OMPI_MCA_coll_libnbc_iallreduce_algorithm" not in os.environ:
            _tuner = _open()
    return _tuner


def _open() -> Tuner | None:
    try:
        lib = ctypes.CDLL(None)  # libmpi, already loaded by mpi4py
        init = lib.MPI_T_init_thread
    except (OSError, AttributeError):
        return None
    provided = ctypes.c_int()
    if init(_THREAD_MULTIPLE, ctypes.byref(provided)) != 0:
        return None
    idx, count = ctypes.c_int(), ctypes.c_int()
    handle = ctypes.c_void_p()
    value = ctypes.c_int(-1)
    ok = (lib.MPI_T_cvar_get_index(_CVAR, ctypes.byref(idx)) == 0
          and lib.MPI_T_cvar_handle_alloc(idx, None, ctypes.byref(handle), ctypes.byref(count)) == 0)
    if ok and count.value == 1 and lib.MPI_T_cvar_read(handle, ctypes.byref(value)) == 0 \
            and value.value == _DEFAULT:
        return Tuner(lib, handle)
    if ok:
        lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
    lib.MPI_T_finalize()
    return None


def release() -> None:
    """At exit, before MPI_Finalize: give the variable back and close MPI_T."""
    global _tuner
    t, _tuner = _tuner, None
    if t is not None:
        t.close()
