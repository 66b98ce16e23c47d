"""2-D heat equation on a cartesian process grid: halo exchange, checkpoints, restart on any rank count.

    mpirun -n 4 python examples/08_heat2d.py --steps 200 --save-every 50 --ckpt-dir ckpt/heat
    mpirun -n 3 python examples/08_heat2d.py --steps 300 --ckpt-dir ckpt/heat   # resumes at 200
    python examples/08_heat2d.py --check          # one rank; --check compares with serial numpy

An explicit five-point scheme on an ``ny x nx`` plate whose edges are held at 0 (a hot square in
the middle to start with). The plate is cut into blocks over a ``dims_create`` grid of ranks;
each step every rank trades one ghost row/column with each neighbour (``sendrecv``: a neighbour
beyond the plate's edge is ``PROC_NULL``, so edge ranks need no branches), then updates its
block. Every ``--save-every`` steps the blocks go to one checkpoint (``Shard``: each rank writes
its block of the global field); a run finds the newest and continues from it on however many
ranks it has. ``--check`` gathers the field and compares it with the same steps run serially:
the update is elementwise, so the result is bit-for-bit the serial one.

The same with mpi4py, for comparison (the halo exchange of one step)::

    cart = comm.Create_cart(MPI.Compute_dims(size, 2), periods=[False, False])
    up, down = cart.Shift(0, 1); left, right = cart.Shift(1, 1)
    cart.Sendrecv(u[1], up, recvbuf=u[-1], source=down)
    cart.Sendrecv(u[-2], down, recvbuf=u[0], source=up)
    cart.Sendrecv(u[:, 1].copy(), left, recvbuf=col, source=right); u[:, -1] = col
    cart.Sendrecv(u[:, -2].copy(), right, recvbuf=col, source=left); u[:, 0] = col
"""
from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

import hpcdp
from hpcdp.checkpoint import Shard

ALPHA = 0.2  # diffusion number: stable below 0.25


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ny", type=int, default=48, help="rows of the plate")
    p.add_argument("--nx", type=int, default=64, help="columns of the plate")
    p.add_argument("--steps", type=int, default=100, help="time steps in all (resumed runs count on)")
    p.add_argument("--ckpt-dir", default=None, help="checkpoints go here; a run resumes from the newest")
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: none)")
    p.add_argument("--check", action="store_true", help="compare with serial numpy at the end")
    return p.parse_args(argv)


def initial(ny: int, nx: int) -> np.ndarray:
    """The plate at step 0: a hot square in the middle."""
    u = np.zeros((ny, nx))
    u[ny // 4: 3 * ny // 4, nx // 4: 3 * nx // 4] = 1.0
    return u


def step(u: np.ndarray) -> None:
    """One explicit step of the interior of ``u`` (one ghost layer around it), in place."""
    c = u[1:-1, 1:-1]
    c += ALPHA * (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4.0 * c)


def serial(ny: int, nx: int, steps: int) -> np.ndarray:
    """The reference: the same steps on one array (edges 0)."""
    u = np.zeros((ny + 2, nx + 2))
    u[1:-1, 1:-1] = initial(ny, nx)
    for _ in range(steps):
        step(u)
    return u[1:-1, 1:-1]


def bounds(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows (or columns) ``[lo, hi)`` of block ``i`` of ``parts``: as even as they go."""
    q, r = divmod(n, parts)
    lo = i * q + min(i, r)
    return lo, lo + q + (i < r)


def halo(cart: Any, u: np.ndarray, col: np.ndarray) -> None:
    """Fill the ghost layer of ``u`` from the four neighbours (PROC_NULL: the edge stays 0)."""
    up, down = cart.shift(0, 1)       # up: the row of blocks above (smaller row index)
    left, right = cart.shift(1, 1)
    cart.sendrecv(u[1], up, u[-1], down)            # first row up, bottom ghost from below
    cart.sendrecv(u[-2], down, u[0], up)            # last row down, top ghost from above
    if left != hpcdp.PROC_NULL or right != hpcdp.PROC_NULL:
        got = cart.sendrecv(u[:, 1].copy(), left, col, right)   # columns are strided: copies
        if right != hpcdp.PROC_NULL:
            u[:, -1] = got
        got = cart.sendrecv(u[:, -2].copy(), right, col, left)
        if left != hpcdp.PROC_NULL:
            u[:, 0] = got


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    hpcdp.init()
    g = hpcdp.get_default_group()
    cart = g.cart(hpcdp.dims_create(g.size, 2))
    (r0, r1), (c0, c1) = (bounds(args.ny, cart.dims[0], cart.coords[0]),
                          bounds(args.nx, cart.dims[1], cart.coords[1]))
    u = np.zeros((r1 - r0 + 2, c1 - c0 + 2))
    col = np.empty(r1 - r0 + 2)

    def state(t: int) -> dict[str, Any]:
        return {"u": Shard(u[1:-1, 1:-1].copy(), (args.ny, args.nx), (r0, c0)), "step": t}

    t, resumed = 0, None
    path = hpcdp.checkpoint.latest(args.ckpt_dir) if args.ckpt_dir else None
    if path is not None:
        loaded = hpcdp.checkpoint.load(path, like=state(0))   # this rank's block, any old layout
        u[1:-1, 1:-1] = loaded["u"].local
        t = resumed = int(loaded["step"])
    else:
        u[1:-1, 1:-1] = initial(args.ny, args.nx)[r0:r1, c0:c1]
    while t < args.steps:
        halo(cart, u, col)
        step(u)
        t += 1
        if args.ckpt_dir and args.save_every and t % args.save_every == 0:
            hpcdp.checkpoint.save(os.path.join(args.ckpt_dir, f"step-{t}"), state(t), keep_last=2)
    total = cart.allreduce(np.array([u[1:-1, 1:-1].sum()]))[0]
    out: dict[str, Any] = {"steps": t, "resumed_from": resumed, "dims": list(cart.dims),
                           "heat": float(total)}
    if args.check:  # every rank's block into the global field (small plates only)
        whole = np.zeros((args.ny, args.nx))
        whole[r0:r1, c0:c1] = u[1:-1, 1:-1]
        whole = cart.allreduce(whole)   # blocks are disjoint: the sum places each one
        out["matches_serial"] = bool(np.array_equal(whole, serial(args.ny, args.nx, t)))
    if g.rank == 0:
        tail = f", matches serial numpy: {out['matches_serial']}" if args.check else ""
        start = f" (resumed at step {resumed})" if resumed is not None else ""
        print(f"heat2d: {t} steps{start} on a {cart.dims[0]}x{cart.dims[1]} grid of "
              f"{g.size} rank(s); heat left {total:.12f}{tail}", flush=True)
    return out


if __name__ == "__main__":
    main()
    hpcdp.finalize()
