"""Nothing on the network path can unpickle: proven on the source, not only intended.

The RPC layer (``hpcdp/rpc/``) and the TCP backend with its rendezvous store
(``hpcdp/backends/tcp/``) read bytes from peers; unpickling any of them would run code a peer
chose. This test parses every module there with ``ast`` (a grep would miss ``from pickle import
loads as l`` or ``__import__("pickle")`` and flag comments) and fails on any road to a pickle:

- an import of a module that (un)pickles or loads code: pickle, _pickle, cPickle, dill,
  cloudpickle, marshal, shelve, copyreg, jsonpickle, joblib, multiprocessing's connection and
  managers (their ``recv`` unpickles), also through ``importlib.import_module``/``__import__``;
  any other use of those names (``mpi4py.MPI.pickle``, ``pickle.loads`` reached some other way);
- ``__reduce__`` / ``__reduce_ex__`` / ``__setstate__`` / ``__getstate__`` / ``__getnewargs__``
  used or defined, except a definition that only raises (refusing to be pickled);
- numpy's ``allow_pickle=`` set to anything but the constant False;
- mpi4py's lowercase, pickle-based calls (``comm.recv``, ``comm.bcast``, ``irecv``,
  ``sendrecv``...): on a receiver whose name says communicator (``comm``, ``MPI``), anywhere;
  on any receiver in a module that uses MPI (where ``sock.recv`` cannot be meant);
- hpcdp's own object collectives (``broadcast_object``, ``all_gather_object``,
  ``gather_object``), which pickle.

The scanner is checked first on planted sources, so a scanner that flags nothing fails too.
"""
from __future__ import annotations

import ast
import os
import textwrap

import pytest
from conftest import parse_source  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCANNED = ["hpcdp/rpc", "hpcdp/backends/tcp"]

PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve",
                    "copyreg", "copy_reg", "jsonpickle", "joblib", "multiprocessing.connection",
                    "multiprocessing.managers"}
PICKLE_HOOKS = {"__reduce__", "__reduce_ex__", "__setstate__", "__getstate__", "__getnewargs__",
                "__getnewargs_ex__"}
#: mpi4py's lowercase methods: they pickle what they send and unpickle what they receive
MPI_PICKLE_CALLS = {"send", "isend", "ssend", "issend", "bsend", "ibsend", "recv", "irecv",
                    "mrecv", "imrecv", "recv_mprobe", "sendrecv", "bcast", "ibcast", "gather",
                    "igather", "scatter", "iscatter", "allgather", "iallgather", "alltoall",
                    "ialltoall", "reduce", "ireduce", "allreduce", "iallreduce", "scan", "exscan",
                    "neighbor_allgather", "neighbor_alltoall"}
OBJECT_COLLECTIVES = {"broadcast_object", "all_gather_object", "gather_object"}


def _pickling(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in PICKLING_MODULES)


def _dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain ('' for anything else in it)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "")
    return ".".join(reversed(parts))


def _only_raises(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                       and isinstance(s.value.value, str))]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _uses_mpi(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mpi4py" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpi4py":
            return True
        if isinstance(node, ast.Name) and node.id == "MPI" or \
                isinstance(node, ast.Attribute) and node.attr == "MPI":
            return True
    return False


def scan(source: str, filename: str = "<planted>") -> list[str]:
    """Every road to a pickle in ``source``, as ``file:line: what``."""
    tree = parse_source(source, filename)
    mpi_module = _uses_mpi(tree)
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _pickling(a.name):
                    flag(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            for a in node.names:
                if _pickling(mod) or _pickling(f"{mod}.{a.name}" if mod else a.name) \
                        or a.name in PICKLING_MODULES or a.name in OBJECT_COLLECTIVES:
                    flag(node, f"from {mod or '.'} import {a.name}")
        elif isinstance(node, ast.Name) and (node.id in PICKLING_MODULES or node.id in PICKLE_HOOKS):
            flag(node, f"uses the name {node.id}")
        elif isinstance(node, ast.Attribute) and (node.attr in PICKLING_MODULES
                                                  or node.attr in PICKLE_HOOKS):
            flag(node, f"uses {_dotted(node) or '...'}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name in PICKLE_HOOKS and not _only_raises(node):
            flag(node, f"defines {node.name} (only one that raises is allowed)")
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle" and not (
                isinstance(node.value, ast.Constant) and node.value.value is False):
            flag(node.value, "allow_pickle= other than False")
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = _dotted(fn)
        last = name.rsplit(".", 1)[-1] if name else getattr(fn, "attr", "")
        if last in ("import_module", "__import__") and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and _pickling(node.args[0].value):
            flag(node, f"{last}({node.args[0].value!r})")
        if isinstance(fn, ast.Attribute):
            receiver = _dotted(fn.value).lower()
            if fn.attr in MPI_PICKLE_CALLS and (mpi_module or "comm" in receiver
                                                or "mpi" in receiver):
                flag(node, f"mpi4py's pickle-based {_dotted(fn) or fn.attr}()")
            if fn.attr in OBJECT_COLLECTIVES:
                flag(node, f"pickling object collective {fn.attr}()")
        elif isinstance(fn, ast.Name) and fn.id in OBJECT_COLLECTIVES:
            flag(node, f"pickling object collective {fn.id}()")
    return found


def _sources() -> list[tuple[str, str]]:
    out = []
    for top in SCANNED:
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    with open(path, encoding="utf-8") as fh:
                        out.append((os.path.relpath(path, ROOT), fh.read()))
    return out


# -- the scanner catches what it must, and only that ------------------------------------------
PLANTED = {
    "import pickle": "import pickle",
    "aliased from-import": "from pickle import loads as l",
    "cPickle": "import cPickle as p",
    "dill": "import dill",
    "cloudpickle": "import cloudpickle",
    "marshal": "import marshal",
    "shelve": "from shelve import open",
    "multiprocessing connection": "from multiprocessing.connection import Client",
    "multiprocessing connection module": "from multiprocessing import connection",
    "pickle reached without an import": "obj = pickle.loads(data)",
    "import_module": "import importlib\nm = importlib.import_module('pickle')",
    "__import__": "m = __import__('marshal')",
    "mpi4py's pickle": "from mpi4py import MPI\nMPI.pickle.__init__(None, None)",
    "allow_pickle=True": "import numpy as np\nnp.load(f, allow_pickle=True)",
    "allow_pickle from a variable": "import numpy as np\nnp.load(f, allow_pickle=flag)",
    "__reduce__ defined": "class A:\n    def __reduce__(self):\n        return (A, ())",
    "__setstate__ defined": "class A:\n    def __setstate__(self, st):\n        self.__dict__ = st",
    "__reduce__ called": "x = obj.__reduce__()",
    "comm.recv": "msg = comm.recv(source=0)",
    "self.comm.bcast": "x = self.comm.bcast(x, root=0)",
    "irecv in an MPI module": "from mpi4py import MPI\nreq = world.irecv(source=1)",
    "object collective": "got = group.broadcast_object(x, root=0)",
    "object collective imported": "from hpcdp import all_gather_object",
}
CLEAN = {
    "refusing to be pickled": 'class R:\n    def __reduce__(self):\n        """No."""\n'
                              '        raise TypeError("cannot be pickled")',
    "allow_pickle=False": "import numpy as np\nnp.load(f, allow_pickle=False)",
    "sockets outside MPI": "n = sock.send(b)\nbuf = sock.recv(4)\nreader.recv(sock, True)",
    "uppercase MPI": "from mpi4py import MPI\ncomm.Recv([buf, MPI.BYTE], 0)\ncomm.Bcast(a)",
    "the word in text": '"""nothing is ever unpickled: no pickle"""\nx = "import pickle"',
    "msgpack": "import msgpack\nv = msgpack.unpackb(b, raw=False)",
}


@pytest.mark.parametrize("what", sorted(PLANTED))
def test_scanner_flags_a_planted_pickle(what: str) -> None:
    assert scan(textwrap.dedent(PLANTED[what])), f"{what!r} not flagged"


@pytest.mark.parametrize("what", sorted(CLEAN))
def test_scanner_leaves_safe_code_alone(what: str) -> None:
    assert scan(textwrap.dedent(CLEAN[what])) == []


def test_scanner_flags_import_pickle_planted_in_the_store() -> None:
    """The real TCP store's source, with one planted ``import pickle`` deep inside a function."""
    path = os.path.join(ROOT, "hpcdp", "backends", "tcp", "_store.py")
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("    def "))
    indent = " " * (len(lines[at + 1]) - len(lines[at + 1].lstrip()))
    planted = "\n".join(lines[:at + 1] + [indent + "import pickle"] + lines[at + 1:])
    assert scan("\n".join(lines), path) == []
    found = scan(planted, path)
    assert found == [f"{path}:{at + 2}: import pickle"], found


# -- the network path itself ------------------------------------------------------------------
def test_network_path_never_unpickles() -> None:
    sources = _sources()
    names = {p for p, _ in sources}
    # the scan really covers the network path (a moved directory must not make it vacuous)
    assert "hpcdp/backends/tcp/_store.py" in names and "hpcdp/rpc/_codec.py" in names, names
    assert len(sources) >= 25, sorted(names)
    found = [f for path, text in sources for f in scan(text, path)]
    assert not found, "roads to a pickle on the network path:\n" + "\n".join(found)
