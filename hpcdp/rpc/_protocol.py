"""Message kinds and the envelope fields each carries (see ``_wire`` for the frame itself).

Ids are ``[rank, 16 random bytes]``; a FORK's token is its parent's proof (``_rref``).

Requests (answered by RESULT or ERROR with the same id, from the same peer)::

    CALL    [kind, id, name]                                body: (args, kwargs)
    REMOTE  [kind, id, name, rref_id, fork_id, target, method] body: (args, kwargs)
    RCALL   [kind, id, rref_id, method]                     body: (args, kwargs)
    FETCH   [kind, id, rref_id]                             body: None
    FORK    [kind, id, rref_id, fork_id, parent, token]     body: None
    ACCEPT  [kind, id, fork_id]                             body: None
    DELETE  [kind, id, rref_id, fork_id]                    body: None
    RESULT  [kind, id]                                      body: the value
    ERROR   [kind, id]                                      body: (type name, message, traceback)

Shutdown coordination (not counted as traffic; answered by CRESULT)::

    READY [kind, id]   PROBE [kind, id]   GO [kind, id]   CRESULT [kind, id]  body: value
"""
from __future__ import annotations

CALL, REMOTE, RCALL, FETCH, FORK, ACCEPT, DELETE, RESULT, ERROR = range(1, 10)
READY, PROBE, GO, CRESULT = range(10, 14)

NAMES = {CALL: "CALL", REMOTE: "REMOTE", RCALL: "RCALL", FETCH: "FETCH", FORK: "FORK",
         ACCEPT: "ACCEPT", DELETE: "DELETE", RESULT: "RESULT", ERROR: "ERROR", READY: "READY",
         PROBE: "PROBE", GO: "GO", CRESULT: "CRESULT"}
BY_NAME = {v: k for k, v in NAMES.items()}

#: kinds counted for the shutdown's quiescence check (everything but the coordination itself)
COUNTED = frozenset(range(CALL, ERROR + 1))
REQUESTS = frozenset({CALL, REMOTE, RCALL, FETCH, FORK, ACCEPT, DELETE, READY, PROBE, GO})
REPLIES = frozenset({RESULT, ERROR, CRESULT})
CONTROL = frozenset({READY, PROBE, GO, CRESULT})
#: requests that hold their message (arguments, or the value to send) until served: charged to
#: the callee's queue budget (``HPCDP_RPC_QUEUE_BYTES``) from arrival to their reply
QUEUED = frozenset({CALL, REMOTE, RCALL, FETCH})

#: caps on the text of a remote error
MAX_ERROR_TEXT = 64 << 10
