"""Hooks on tensors that hold their owner weakly.

Why: a parameter's hook lives in torch's C++ autograd state, which Python's garbage
collector cannot see into; a hook bound to the engine that holds the parameter makes a
cycle the collector never frees. Measured: every ZeRO-3 run kept its whole model,
shard and slots (900 MiB for a 50 M parameter transformer) for the life of the process,
so a second run in one process (a notebook, a sweep, a test's warm ranks) held both.
"""

from __future__ import annotations

import weakref


def weak_hook(method, *first):
    """A hook calling the bound `method(*first, *hook_args)` while its object lives;
    it holds the object weakly (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*first, *args)

    return hook
