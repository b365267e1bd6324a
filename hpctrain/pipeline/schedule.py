"""Per-stage orders of forward (F) and backward (B) micro-batch work.

GPipe (Huang et al. 2019): all m forwards, then all m backwards, so every stage keeps
the activations of all m micro-batches. 1F1B (PipeDream-Flush, Narayanan et al. 2021;
DeepSpeed's TrainSchedule): stage s runs P-s-1 warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards, so it never keeps more
than P-s micro-batches. Both take the same time per step; the bubble fraction is
(P-1)/(m+P-1) when stages are equally fast. The orders are consistent across stages
(every stage sends micro-batches in increasing order both ways), so with non-blocking
sends no stage can wait on work that waits on it.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b")


def stage_actions(schedule: str, stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """[("F", i) | ("B", i), ...] for one stage and one optimizer step."""
    if schedule == "gpipe":
        return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]
    if schedule != "1f1b":
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    warmup = min(stages - stage - 1, micro)
    actions = [("F", i) for i in range(warmup)]
    for i in range(micro - warmup):
        actions += [("F", warmup + i), ("B", i)]
    actions += [("B", i) for i in range(micro - warmup, micro)]
    return actions


def peak_in_flight(actions: list[tuple[str, int]]) -> int:
    """Most micro-batches whose activations a stage holds at once under `actions`."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def bubble_theory(stages: int, micro: int) -> float:
    """Idle share of a step with equal stage times: (P-1)/(m+P-1)."""
    return (stages - 1) / (micro + stages - 1)
