"""torch tensors at the API boundary: zero-copy numpy (CPU) or cupy (CUDA) views, and back.

hpcdp never imports torch: a tensor can only exist once the user's program imported torch, so it
is recognised through ``sys.modules`` (as ``_arrays.cupy_or_none`` finds cupy) and a numpy user
pays nothing. A public call that is handed a tensor makes one ``TensorCall``, passes each
argument through it (``read`` for what the call only reads, ``write`` for what it fills in
place), runs the ordinary numpy/cupy call on the views, and hands the result to ``back``.

The rules, the same in every collective and point-to-point call:

- A CPU tensor becomes a numpy view of its storage (``t.detach().numpy()``); a CUDA tensor a
  cupy view by DLPack (``cupy.from_dlpack``), which then takes the cupy path. Nothing is copied,
  so ``out=`` and the in-place torch spellings write the tensor itself. A call that returns a
  new array returns a tensor (``torch.from_numpy``/``torch.from_dlpack``: no copy) when its
  input was one; a result that *is* an argument (``out=``) is returned as that tensor.
- Non-contiguous tensors follow the numpy rule: inputs are read through their strides (copied
  contiguous where a transport needs it), ``out=``/in-place targets are written through their
  strides. A target some of whose elements share memory (``expand``, stride 0) is refused, as
  torch refuses in-place writes to it.
- ``requires_grad``: inputs are read through ``.detach()``. A target that requires grad is
  written only where torch itself would allow an in-place write, with grad mode off
  (``torch.no_grad()``); else TypeError. Every target written has its version counter bumped,
  as torch's in-place ops do, so autograd notices a tensor it saved being overwritten. hpcdp's
  numpy-style ``broadcast(x)``, which fills ``x`` "when it can", treats such a tensor as it
  treats a read-only array: it returns a new tensor instead. Results carry no autograd history.
- bfloat16, which numpy lacks: calls that only move data (broadcast, gather, scatter, all-to-all,
  point to point) move its 16-bit payload as int16, bit for bit; reductions compute in float32
  and round once to bfloat16 (torch's round-to-nearest-even), as float16 is reduced where a
  transport has no half type. A bfloat16 call takes bfloat16 arguments only.
- float8, complex32, quantized, sparse and tensors on devices other than CPU/CUDA: TypeError.
"""
from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import numpy as np

from ._arrays import is_cupy

__all__ = ["torch_or_none", "is_tensor", "tensors_in", "tensor_call", "TensorCall"]

#: torch dtypes with a numpy twin of the same name (torch.uint16/32/64 exist from torch 2.3)
_TWINS = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128")
_TABLE: dict[Any, np.dtype] = {}


def torch_or_none() -> ModuleType | None:
    """torch if the user already imported it; hpcdp never imports it."""
    return sys.modules.get("torch")


def is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def tensors_in(*xs: Any) -> bool:
    """Whether any argument is a tensor, or a list/tuple holding one (torch's list forms)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    cls = torch.Tensor
    for x in xs:
        if isinstance(x, cls) or (type(x) in (list, tuple) and any(isinstance(e, cls) for e in x)):
            return True
    return False


def tensor_call(where: str, *xs: Any, reduce: bool = False) -> TensorCall | None:
    """A ``TensorCall`` for a call whose arguments ``xs`` hold a tensor, else None."""
    return TensorCall(where, reduce=reduce) if tensors_in(*xs) else None


def _numpy_dtype(torch: ModuleType, dt: Any) -> np.dtype | None:
    if not _TABLE:
        _TABLE.update({getattr(torch, n): np.dtype(n) for n in _TWINS if hasattr(torch, n)})
    return _TABLE.get(dt)


def _cupy() -> ModuleType:
    """cupy for a CUDA tensor (imported here if the program has not: the tensor proves a GPU)."""
    cp = sys.modules.get("cupy")
    if cp is not None:
        return cp
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise TypeError("CUDA tensors go through cupy (DLPack, no copy), which is not installed: "
                        "pip install cupy-cuda12x (or the wheel for your CUDA), or pass t.cpu()") from exc


def _may_overlap(strides: Any, shape: Any) -> bool:
    """Whether two elements of a strided view may share memory: sorted by stride, each axis must
    step past the whole extent of the axes below it (a sufficient test; stride 0 fails it)."""
    dims = sorted((abs(s), n) for s, n in zip(strides, shape) if n > 1)
    reach = 0
    for stride, n in dims:
        if stride <= reach:
            return True
        reach += stride * (n - 1)
    return False


class TensorCall:
    """The tensors of one public call: their array views, and how its result goes back.

    ``read``/``write`` return the array a numpy/cupy call takes in a tensor's place (the same
    object for the same tensor, so ``out is x`` still means in place); ``back`` runs once the
    call completed (a ``Work``'s completion: ``comm._buffers.via_tensors``): bfloat16 results
    reduced in float32 are rounded into their tensors, written tensors' version counters bumped,
    and arrays returned become tensors.
    """

    __slots__ = ("_torch", "_where", "_reduce", "_views", "_owner", "_staged", "_written",
                 "_input", "_kinds")

    def __init__(self, where: str, *, reduce: bool = False) -> None:
        self._torch = sys.modules["torch"]
        self._where = where
        self._reduce = reduce  # a reduction: bfloat16 computes in float32
        self._views: dict[int, tuple[Any, Any, Any]] = {}  # id(tensor) -> (tensor, array, f32 copy)
        self._owner: dict[int, Any] = {}  # id(array) -> its tensor (kept alive by _views)
        self._staged: list[tuple[Any, Any]] = []  # (bfloat16 target, its float32 copy)
        self._written: list[Any] = []  # targets whose version counters to bump
        self._input: Any = None  # the first tensor read: what a new result is made like
        self._kinds: dict[str, str] = {}  # "bf16"/"other" -> the first such argument's dtype

    # -- arguments ------------------------------------------------------------------------------
    def read(self, x: Any) -> Any:
        """The array to pass for an input ``x`` (non-tensors, None included, pass through)."""
        if not isinstance(x, self._torch.Tensor):
            if x is not None:
                self._kind(x, "other")
            return x
        if self._input is None:
            self._input = x
        return self._view(x)

    def write(self, x: Any, what: str = "the tensor", *, strict: bool = True) -> Any:
        """The array to pass for ``x``, which the call fills in place. ``strict=False`` (numpy's
        "in place when it can"): a tensor that may not be written gives a copy of its values,
        which the call fills and returns instead (a new tensor)."""
        if not isinstance(x, self._torch.Tensor):
            if x is not None:
                self._kind(x, "other")
            return x
        torch = self._torch
        if self._input is None:  # (broadcast's x is both; a copy returned for it is a tensor)
            self._input = x
        why = None
        if x.requires_grad and torch.is_grad_enabled():
            why = (f"{what} requires grad, and torch allows writing such a tensor in place only "
                   "under torch.no_grad(); call this under `with torch.no_grad():`, or pass "
                   "t.detach() (the same memory, outside autograd)")
        elif x.is_inference() and not torch.is_inference_mode_enabled():
            why = (f"{what} is an inference tensor, which torch lets be written in place only "
                   "inside torch.inference_mode(); pass t.clone()")
        elif x.is_conj() or x.is_neg():
            why = (f"{what} is a lazily conjugated/negated view (is_conj/is_neg); pass "
                   "t.resolve_conj().resolve_neg() and read the result from it")
        if why is not None:
            if strict:
                raise TypeError(f"{self._where}: {why}")
            return self._view(x).copy()
        arr = self._view(x)
        f32 = self._views[id(x)][2]
        if f32 is not None and all(t is not x for t, _ in self._staged):
            self._staged.append((x, f32))  # reduced in float32: rounded into x by back()
        if _may_overlap(x.stride(), x.shape):
            raise ValueError(f"{self._where}: {what} has elements that share memory (an expand()ed "
                             f"or as_strided view, strides {tuple(x.stride())}); torch refuses "
                             "in-place writes to it too: pass t.contiguous()")
        if all(w is not x for w in self._written):
            self._written.append(x)
        return arr

    def out(self, x: Any) -> Any:
        """``write`` for an ``out=`` argument."""
        return self.write(x, "out=")

    def read_list(self, xs: Any) -> Any:
        return [self.read(x) for x in xs] if type(xs) in (list, tuple) else self.read(xs)

    def write_list(self, xs: Any, what: str) -> Any:
        if type(xs) not in (list, tuple):
            return self.write(xs, what)
        return [self.write(x, f"{what}[{i}]") for i, x in enumerate(xs)]

    def _kind(self, x: Any, kind: str) -> None:
        """A bfloat16 call takes bfloat16 tensors only: its payload travels as int16 (or its
        reduction as float32), which another argument of those types would silently match."""
        kinds = self._kinds
        kinds.setdefault(kind, f"{type(x).__name__} of {getattr(x, 'dtype', '?')}")
        if len(kinds) > 1:
            raise TypeError(f"{self._where}: bfloat16 tensors cannot share a call with a "
                            f"{kinds['other']} (numpy has no bfloat16 to compare or convert "
                            "with); pass bfloat16 tensors only")

    def _view(self, t: Any) -> Any:
        """The numpy/cupy array for ``t`` (made once per call and tensor)."""
        got = self._views.get(id(t))
        if got is not None:
            return got[1]
        torch = self._torch
        where = self._where
        if t.layout is not torch.strided:
            raise TypeError(f"{where}: {t.layout} tensors are not supported; pass t.to_dense()")
        if t.is_quantized:
            raise TypeError(f"{where}: quantized tensors ({t.dtype}) are not supported; pass "
                            "t.dequantize()")
        device = t.device.type
        if device not in ("cpu", "cuda"):
            raise TypeError(f"{where}: tensors on {t.device} are not supported (CPU tensors go "
                            "through numpy, CUDA tensors through cupy); pass t.cpu()")
        base = t.detach()
        if base.is_conj() or base.is_neg():  # (a target was refused already in write())
            base = base.resolve_conj().resolve_neg()
        f32 = None
        if t.dtype is torch.bfloat16:
            self._kind(t, "bf16")
            if self._reduce:  # reduced in float32, rounded once at the end (back)
                base = f32 = base.float()
            else:  # moved as its 16-bit payload
                base = base.view(torch.int16)
        else:
            self._kind(t, "other")
            if _numpy_dtype(torch, t.dtype) is None:
                raise TypeError(f"{where}: tensors of {t.dtype} are not supported (numpy has no such "
                                "type); supported: bool, (u)int8-64, float16/32/64, complex64/128 "
                                "and bfloat16; convert first, e.g. t.float()")
        if device == "cpu":
            arr = base.numpy()
        else:
            cp = _cupy()
            if base.dtype is torch.bool:  # DLPack's bool is recent: move it as bytes
                arr = cp.from_dlpack(base.view(torch.uint8)).view(cp.bool_)
            else:
                arr = cp.from_dlpack(base)
        self._views[id(t)] = (t, arr, f32)
        self._owner[id(arr)] = t
        return arr

    # -- the result -----------------------------------------------------------------------------
    def back(self, result: Any) -> Any:
        """Finish the call (bfloat16 targets rounded, version counters bumped) and return
        ``result`` with its arrays as tensors."""
        torch = self._torch
        if self._staged:
            with torch.no_grad():
                for t, f32 in self._staged:
                    t.copy_(f32)  # rounds to nearest even, and bumps t's version
        bump = getattr(getattr(torch.autograd, "graph", None), "increment_version", None)
        if bump is not None:
            staged = {id(t) for t, _ in self._staged}
            live = [t for t in self._written if id(t) not in staged and not t.is_inference()]
            if live:
                bump(live)
        return self._tensor(result)

    def _tensor(self, a: Any) -> Any:
        if a is None:
            return None
        owner = self._owner.get(id(a))
        if owner is not None:
            return owner
        if type(a) is tuple:  # recv(..., return_status=True): (buffer, Status)
            return tuple(self._tensor(e) for e in a)
        like = self._input
        if like is None:
            return a  # no tensor input: a new result stays numpy, as for numpy input
        torch = self._torch
        if isinstance(a, (np.ndarray, np.generic)):
            t = torch.from_numpy(np.asarray(a))
        elif is_cupy(a):
            if a.dtype == np.bool_:
                t = torch.from_dlpack(a.view(np.uint8)).view(torch.bool)
            else:
                t = torch.from_dlpack(a)
        else:
            return a
        if like.dtype is torch.bfloat16:
            t = t.to(torch.bfloat16) if t.dtype is torch.float32 else t.view(torch.bfloat16)
        return t
