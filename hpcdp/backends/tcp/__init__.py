"""TCP backend: an authenticated full mesh of sockets between ranks, no MPI needed.

Layers, bottom up: ``_wire`` (frame header, secret, handshake), ``_accept`` (the listener gate
shared by the store and the mesh), ``_store`` (rank 0's key-value rendezvous), ``_peer`` and
``_frames`` (per-socket state and the resumable frame parser), ``_coll`` (collective signatures
in every frame), ``_transport`` (the mesh: one reader thread, tag-matched queues; it holds a parser and the
checks, built over its queues, rather than inheriting them) and
``_backend`` (``TCPBackend`` over ``_runner.P2PBackend``, and ``create_world``).
"""
from __future__ import annotations

from ._backend import TCPBackend, _World, bind_address, create_world
from ._wire import check_secret, is_loopback

__all__ = ["TCPBackend", "create_world", "bind_address", "check_secret", "is_loopback"]
