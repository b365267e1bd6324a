"""Routing decisions of one MoE layer on one rank's batch, in numpy (no framework, no MPI).

Which experts a token goes to, whether it fits in their capacity, and in which order
rows are packed for the all-to-all are not differentiable decisions, so they are made
once here from the (detached) router probabilities and shared by both backends; the
backends only gather and scatter with the index arrays this returns.

Priority rule for dropping (as GShard's top-2 and Switch): every token's first choice is
served before any second choice, and within one choice rank tokens are served in batch
order (flattened [batch, time]). A choice that finds its expert full is dropped; a token
whose choices are all dropped leaves the layer as zeros, i.e. it passes through on the
residual path. Kept gate weights are not renormalised after a drop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Routing:
    """Routing of T tokens over E experts with top-k choices (k = experts.shape[1])."""

    experts: np.ndarray  # [T, k] int64: chosen experts, most probable first (ties: lower id)
    kept: np.ndarray  # [T, k] bool: the choice fits in its expert's capacity
    send_token: np.ndarray  # [S] int64: token of each dispatched row, grouped by expert
    send_slot: np.ndarray  # [S] int64: which of the token's k choices the row is
    routed: np.ndarray  # [E] int64: choices per expert before capacity
    kept_counts: np.ndarray  # [E] int64: rows per expert after capacity (what is sent)
    capacity: int

    @property
    def dropped(self) -> int:
        return int(self.routed.sum() - self.kept_counts.sum())


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """[T, k] indices of the k largest probabilities per row; ties go to the lower index."""
    return np.argsort(-probs, axis=1, kind="stable")[:, :k].astype(np.int64)


def route(probs: np.ndarray, k: int, capacity: int) -> Routing:
    """Top-k choices, capacity (priority rule in the module docstring) and packing order."""
    tokens, n_experts = probs.shape
    experts = top_k(probs, k)
    flat = experts.T.reshape(-1)  # priority order: slot-major, then token order
    order = np.argsort(flat, kind="stable")  # grouped by expert, priority kept inside
    grouped = flat[order]
    first = np.searchsorted(grouped, grouped, side="left")
    position = np.empty_like(flat)
    position[order] = np.arange(flat.size) - first  # place in the expert's queue
    kept_flat = position < capacity
    send = order[kept_flat[order]]
    routed = np.bincount(flat, minlength=n_experts).astype(np.int64)
    kept_counts = np.bincount(flat[kept_flat], minlength=n_experts).astype(np.int64)
    return Routing(
        experts=experts,
        kept=kept_flat.reshape(k, tokens).T.copy(),
        send_token=(send % tokens).astype(np.int64),
        send_slot=(send // tokens).astype(np.int64),
        routed=routed,
        kept_counts=kept_counts,
        capacity=int(capacity),
    )


def load_fractions(routed: np.ndarray, tokens: int, k: int) -> np.ndarray:
    """f_i: the share of the T*k routing choices that picked expert i (sums to 1).

    For k=1 this is Switch's "fraction of tokens dispatched to expert i"; for k=2 both
    choices count, so perfectly balanced routing still gives f_i = 1/E.
    """
    return (routed / max(1, tokens * k)).astype(np.float32)


def aux_loss(probs: np.ndarray, routed: np.ndarray, k: int, alpha: float) -> float:
    """Switch Transformer load-balancing loss alpha * E * sum_i f_i * P_i (1*alpha if uniform)."""
    tokens, n_experts = probs.shape
    f = load_fractions(routed, tokens, k).astype(np.float64)
    p = probs.astype(np.float64).mean(axis=0) if tokens else np.zeros(n_experts)
    return float(alpha * n_experts * np.sum(f * p))
