"""Gradient exchange over MPI, framework-free (numpy buffers and the guarded comm).

The backends copy their gradients into one flat float32 buffer and hand it to a
`Reducer` built by `make_reducer`; what travels on the wire (dense float32, half
precision, sparse top-k, quantized, low-rank, across node leaders first) is this
package's business, never the backend's. The overlapped engine (buckets started from
backward hooks) lives here too, framework-free; the backends only call it from hooks.
"""

from .reducer import DenseMean, Reducer, make_reducer

__all__ = ["DenseMean", "Reducer", "make_reducer"]
