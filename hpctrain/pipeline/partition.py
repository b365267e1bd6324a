"""Cutting a layer sequence into P contiguous stages.

The bubble of a pipeline is set by its slowest stage, so a partition minimises the
largest stage cost (cost = parameter count or measured forward time). Contiguous
min-max partitioning is solved exactly by dynamic programming over the cut points,
which for the tens of layers of a model is instant. Every layer goes to exactly one
stage and every stage gets at least one layer.
"""

from __future__ import annotations

from collections.abc import Sequence

STRATEGIES = ("parameters", "time")


def balanced_counts(costs: Sequence[float], stages: int) -> list[int]:
    """Layers per stage (contiguous, each >= 1) minimising the most expensive stage.

    Among equally good partitions the one with the smallest sum of squared stage costs
    wins, which spreads free layers (flatten, pooling) instead of piling them up.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"))
    # best[k][i]: (max stage cost, sum of squares) for the first i layers in k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == inf:
                    continue
                c = prefix[i] - prefix[j]
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[k][i]:
                    best[k][i], cut[k][i] = cand, j
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def parameter_partition(spec, layers, stages: int) -> list[int]:
    """Layers per stage without measuring: a `pipeline.partition` list as given, else
    balanced by parameter count (`time` is measured at launch; plan-memory plans it by
    parameters)."""
    if isinstance(spec, list):
        return list(spec)
    return balanced_counts([layer.param_count() for layer in layers], stages)


def spec_problem(spec, stages: int) -> str | None:
    """What is wrong with `pipeline.partition` whatever the model (config.py checks it
    with the rest of the configuration, so `hpctrain config` finds it), or None."""
    if isinstance(spec, str):
        if spec not in STRATEGIES:
            return f"pipeline.partition: {spec!r} is not one of {', '.join(STRATEGIES)} or a list"
        return None
    if not (
        isinstance(spec, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in spec)
    ):
        return f"pipeline.partition: expected parameters, time or a list of integers, got {spec!r}"
    if len(spec) != stages:
        return f"pipeline.partition: {len(spec)} entries for pipeline.stages={stages}"
    if any(c < 1 for c in spec):
        return f"pipeline.partition: every stage needs at least one layer, got {spec}"
    return None


def check_partition(spec, n_layers: int, stages: int) -> str | None:
    """Why `pipeline.partition` cannot cut `n_layers` into `stages`, or None."""
    if stages > n_layers:
        return (
            f"pipeline.stages={stages} is more than the model's {n_layers} layers: "
            "every stage needs at least one layer"
        )
    if (problem := spec_problem(spec, stages)) or isinstance(spec, str):
        return problem
    if sum(spec) != n_layers:
        return f"pipeline.partition: {spec} sums to {sum(spec)} layers but the model has {n_layers}"
    return None


def stage_bounds(counts: Sequence[int]) -> list[tuple[int, int]]:
    """[start, stop) layer indices of each stage."""
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out
