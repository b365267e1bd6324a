"""Hierarchical allreduce (`train.hierarchical: true`) on the World's node layout.

Three steps, each a guarded collective: reduce-scatter inside the node (shared memory),
so local rank j holds the node's sum of slice j; allreduce of slice j across the nodes
among the ranks with local rank j (one communicator per local rank, all running at
once); allgather inside the node. Only 1/L of the gradients leaves each rank over the
network (L ranks per node), in L parallel streams per node, instead of a flat ring
whose every hop may cross the network.

Per rank: intra-node (L-1)/L S twice over shared memory, inter-node 2(M-1)/M x S/L over
the network (M nodes): at 1,024 or 4,096 ranks the bytes per rank do not grow; the
cross-node ring has M hops. Needs the same ranks per node on every node: otherwise the
flat allreduce is used (said once in the log).

Horovod's own hierarchical allreduce exists only in its NCCL (GPU) builds; on CPU,
`horovod.hierarchical_allreduce` changes nothing (config.py refuses it).
"""

from __future__ import annotations

import logging

import numpy as np

from .reducer import DenseMean, DenseStats, flat_buffer

log = logging.getLogger("hpctrain.exchange")


class HierarchicalMean(DenseStats):
    """Average a flat float32 buffer over the World: node, then across nodes, then node."""

    def __init__(self, world, sizes: list[int], what: str = "gradient allreduce"):
        self.world = world
        self.sizes = [int(n) for n in sizes]
        self.buffer, self.views = flat_buffer(self.sizes)
        self.what = what
        self.flat = None
        layout = world.layout
        per_node = world.allreduce_array(
            np.array([layout.local_size, -layout.local_size]),
            "max",
            "hierarchical allreduce: ranks per node",
        )
        uniform = per_node[0] == -per_node[1]
        if layout.nodes < 2 or layout.local_size < 2 or not uniform:
            if world.is_root:
                log.info(
                    "train.hierarchical: %s: flat allreduce instead",
                    "one node"
                    if layout.nodes < 2
                    else "one rank per node"
                    if uniform
                    else "nodes hold different numbers of ranks",
                )
            self.flat = DenseMean(world, self.sizes, what)
            self.flat.buffer, self.flat.views = self.buffer, self.views
        else:
            self.node = world.node
            self.cross = world.guarded_split("cross-node", color=layout.local_rank, key=layout.node)
            local = layout.local_size
            bounds = np.linspace(0, self.buffer.size, local + 1).astype(np.int64)
            self.counts = np.diff(bounds).tolist()
            if world.is_root:
                log.info(
                    "train.hierarchical: reduce-scatter in each node of %d ranks, allreduce "
                    "across %d nodes, allgather in the node",
                    local,
                    layout.nodes,
                )
        self._sent = 0

    def reduce(self, step: int = 0) -> None:
        if self.flat is not None:
            self.flat.reduce(step)
            self._sent = self.flat._sent
            return
        node, cross = self.node, self.cross
        mine = node.reduce_scatter_sum(self.buffer, self.counts, f"{self.what}: in the node")
        cross.allreduce_inplace(mine, "sum", f"{self.what}: across nodes")
        node.allgather_into(mine, self.buffer, self.counts, f"{self.what}: in the node")
        self.buffer *= np.float32(1.0 / self.world.size)
        L, M = node.size, cross.size
        self._sent = int(2 * (L - 1) * self.buffer.nbytes // L + 2 * (M - 1) * mine.nbytes // M)
