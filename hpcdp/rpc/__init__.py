"""Remote procedure calls and remote references over MPI, TCP and simulated ranks.

::

    import hpcdp, hpcdp.rpc as rpc

    @rpc.register                                  # only registered functions/classes run
    def add(a, b): return a + b

    rpc.init_rpc(f"worker{hpcdp.rank()}")          # collective, after hpcdp.init()
    rpc.rpc_sync("worker1", add, args=(np.ones(3), 2), timeout=5)
    fut = rpc.rpc_async("worker1", "add", args=(1, 2))        # fut.wait/done/then
    rref = rpc.remote("worker1", Table, args=(1000,))         # the value stays on worker1
    rref.rpc_sync().lookup(ids); rref.to_here(); rref.owner()
    rpc.shutdown()                                  # waits for outstanding work everywhere

Safety: a peer can only name what ``@rpc.register`` exposed (functions, classes and their
public methods through RRefs), and values travel as msgpack plus raw array buffers
(``_codec``): nothing is ever unpickled, every size is capped (``Limits``, announced to peers,
which check before sending), and a malformed or forged message is answered with an error
while the worker keeps serving. Messages travel over a duplicate of the group's backend
(``Backend.dup()``, ``_channel``): on TCP its HMAC-authenticated connections, no port of RPC's own.

Semantics: callee functions run concurrently, at most ``num_worker_threads`` at once: a short
callee on the thread that read its request (no hand-off: most of a small call's cost), others
on a pool; a callee that blocks or runs long never stops its worker serving (``_duty``), and a
waiting caller reads its own reply itself. A callee's exception is raised on the caller as
``RemoteError`` (also an instance of the original builtin type) with the remote traceback; every
call has a deadline (``CommTimeoutError``), enforced by the waiting caller itself too; a peer
that disconnects fails the calls pending on it with ``PeerFailureError`` (where the backend
cannot tell a dead peer, MPI, only a peer that leaves can be noticed; a killed one shows as a
timeout). Arrays are sent zero-copy where the backend sends so, from the caller's buffers, and
results from the arrays a callee returns: do not change them until the call completes, and
return copies of state that other calls keep changing. RRefs are reference-counted across
workers (``_rref``) and the owner frees a value once no worker refers to it.
"""
from __future__ import annotations

from ._agent import WorkerInfo
from ._api import (
    get_worker_info, init_rpc, is_initialized, remote, rpc_async, rpc_sync, shutdown, stats,
)
from ._codec import Limits
from ._errors import RemoteError
from ._executor import Executor
from ._future import Future
from ._registry import register
from ._rref import RRef

__all__ = [
    "register", "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "RRef", "Future",
    "RemoteError", "WorkerInfo", "Limits", "get_worker_info", "is_initialized", "stats",
    "Executor",
]
