"""Where hpctrain's own code reads a tensor's value on the host: the CPU-side proof that
a step keeps its values where they live (tests/test_gpu.py proves it on a GPU with
`torch.cuda.set_sync_debug_mode("error")`; CI has no GPU).

On a GPU rank, `float(t)`, `int(t)`, `bool(t)` (an `if` on a tensor), `t.item()`,
`t.tolist()`, `t.numpy()` and `t.cpu()` wait for the device, and so does an op whose
output size depends on the values (`t[mask]` with a boolean mask, `nonzero`, `unique`). On a CPU rank they cost
nothing, so a CPU test cannot time them; it can see them. `HostReads` records each one
whose caller is a module of hpctrain (file:line and function), through torch's dispatcher (the scalar
reads) and wrappers of the methods that do not dispatch on CPU. Reads inside torch
itself (its CPU Adam reading the step count, which lives on the host on a GPU rank too)
are not hpctrain's and are left to the GPU test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hpctrain

PACKAGE = str(Path(hpctrain.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())
aten = torch.ops.aten
SCALAR_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
# outputs whose size depends on the values: a GPU must tell the host the size first
DATA_SIZED = {aten.nonzero.default, aten.masked_select.default}
DATA_SIZED |= {aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default}


def _bool_index(func, args) -> bool:
    """`t[mask]`: indexing by a boolean tensor (its result's size is the mask's count)."""
    if func is not aten.index.Tensor:
        return False
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in args[1] if i is not None)


METHODS = ("tolist", "numpy", "cpu")


def _caller() -> str | None:
    """ "file:line in function" of the first frame outside torch and this module, if it
    is hpctrain's."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != HERE and not name.startswith(TORCH):
            if not name.startswith(PACKAGE):
                return None
            return f"{Path(name).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


class HostReads(TorchDispatchMode):
    """`with HostReads() as reads:` ... `reads.where` lists hpctrain's host reads."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []
        self._saved = {}

    def _note(self, what: str) -> None:
        site = _caller()
        if site is not None:
            self.where.append(f"{what} at {site}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SCALAR_READS or func in DATA_SIZED or _bool_index(func, args):
            self._note(str(func))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def wrapped(t, *a, _original=original, _name=name, **kw):
                self._note(f"Tensor.{_name}")
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)
