"""The exchange layer's array seam (`exchange.transport.Arrays`) for torch tensors on
the process-group transport's device: what ZeRO and the gradient compressors compute
locally, with torch ops where the buffers live (the numpy twin:
runtime/host_arrays.py). Nothing here synchronises the host with a GPU: reductions stay
0-d tensors, host arrays cross with pinned `non_blocking` copies."""

from __future__ import annotations

import torch

from .torch_device import to_device


class TorchArrays:
    device = torch.device("cpu")  # the transport sets its own

    def zeros(self, n: int, dtype: str = "float32"):
        return torch.zeros(int(n), dtype=getattr(torch, dtype), device=self.device)

    @staticmethod
    def square_sum(buf):
        g = buf.double()
        return torch.dot(g, g)

    @staticmethod
    def square_sum_where(buf, mask):
        g = torch.where(mask, buf, 0).double()  # zeros elsewhere: the sum's terms alike
        return torch.dot(g, g)

    @staticmethod
    def scale_(buf, factor: float) -> None:
        buf.mul_(factor)  # a float32 tensor's scalar is rounded to float32, as numpy's

    @staticmethod
    def clip_coefficient(square_sum, max_norm: float):
        norm = torch.sqrt(square_sum.to(torch.float64)) + 1e-6
        # `max_norm / norm` rounds twice (norm's reciprocal first); a tensor made from
        # the host float would be a synchronous copy to a GPU; a fill is a kernel
        coef = torch.full_like(norm, float(max_norm)).div_(norm)
        return torch.clamp(coef, max=1.0)

    @staticmethod
    def copy(buf):
        return buf.clone()

    @staticmethod
    def concat(bufs: list):
        return torch.cat([b.reshape(-1) for b in bufs])

    @staticmethod
    def astype(buf, dtype: str):
        return buf.to(getattr(torch, dtype))

    @staticmethod
    def bitcast(buf, dtype: str):
        target = getattr(torch, dtype)
        if (buf.storage_offset() * buf.element_size()) % target.itemsize:
            buf = buf.clone()  # torch views a wider type only at an aligned offset
        return buf.view(target)

    @staticmethod
    def top_k_indices(buf, k: int):
        return torch.topk(buf.abs(), int(k), sorted=False).indices.to(torch.int32)

    @staticmethod
    def take(buf, idx):
        return buf[idx.long()]

    @staticmethod
    def put_(buf, idx, values) -> None:
        buf[idx.long()] = values

    @staticmethod
    def index_add_(buf, idx, values) -> None:
        buf.index_add_(0, idx.long(), values)

    @staticmethod
    def round_clip(buf, lo: float, hi: float):
        return torch.clamp(torch.round(buf), lo, hi)

    @staticmethod
    def qr(mat):
        return torch.linalg.qr(mat).Q.to(torch.float32)

    def from_host(self, values):
        return to_device(values, self.device)  # pinned on a GPU: non_blocking truly

    @staticmethod
    def to_host(buf):
        return buf.detach().cpu().numpy().copy()


def clip_grads_(grads: list, square_sum, max_norm: float) -> None:
    """torch's clip_grad_norm_ rule given the whole model's float64 sum of squares (a
    0-d tensor where the gradients are): every gradient scaled by the coefficient, 1
    under the limit (exact), so no host `if` waits for a device."""
    scale_grads_(grads, TorchArrays.clip_coefficient(square_sum, max_norm))


def scale_grads_(grads: list, coef) -> None:
    """Every gradient times `coef`, a 0-d tensor on their device (no host read)."""
    if grads:
        torch._foreach_mul_(grads, coef.to(torch.float32))  # as mul_ rounds a scalar
