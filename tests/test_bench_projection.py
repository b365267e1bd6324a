"""The α–β math behind `make bench`'s projection, on synthetic numbers (no MPI, no timing)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import alphabeta as ab  # noqa: E402

ALPHA, BETA = 3e-6, 1 / 2.5e9


def test_ring_time_matches_the_formula():
    assert ab.ring_allreduce_time(1, 1e9, ALPHA, BETA) == 0.0
    # n = 2: two steps of latency, S bytes of traffic
    assert ab.ring_allreduce_time(2, 1e6, ALPHA, BETA) == pytest.approx(2 * ALPHA + 1e6 * BETA)
    # n = 4: 6 steps, 2·3/4 = 1.5 S bytes
    assert ab.ring_allreduce_time(4, 1e6, ALPHA, BETA) == pytest.approx(6 * ALPHA + 1.5e6 * BETA)
    # the bandwidth term tends to 2·β·S: bandwidth-optimal
    big = ab.ring_allreduce_time(10**6, 1e9, 0.0, BETA)
    assert big == pytest.approx(2 * 1e9 * BETA, rel=1e-5)


def _synthetic(noise=0.0, seed=0, ranks=(2, 4, 8)):
    rng = np.random.default_rng(seed)
    sizes = [8 * 4**k for k in range(14)]
    return [
        (n, s, ab.ring_allreduce_time(n, s, ALPHA, BETA) * (1 + noise * rng.standard_normal()))
        for n in ranks
        for s in sizes
    ]


def test_fit_recovers_exact_constants():
    a, b = ab.fit_alpha_beta(_synthetic())
    assert a == pytest.approx(ALPHA, rel=1e-6)
    assert b == pytest.approx(BETA, rel=1e-6)


def test_fit_from_one_rank_count_and_noise():
    a, b = ab.fit_alpha_beta(_synthetic(noise=0.05, ranks=(2,)))
    assert a == pytest.approx(ALPHA, rel=0.15)
    assert b == pytest.approx(BETA, rel=0.15)


def test_fit_weights_small_messages():
    # An absolute least-squares fit would let the 128 MB point swamp α; this one may not.
    pts = _synthetic()
    pts = [(n, s, t * (1.3 if s == max(p[1] for p in pts) else 1.0)) for n, s, t in pts]
    a, _ = ab.fit_alpha_beta(pts)
    assert a == pytest.approx(ALPHA, rel=0.2)


def test_fit_never_returns_negative_constants():
    # pure bandwidth data with a tiny negative latency offset would fit α < 0 unconstrained
    pts = [(2, s, BETA * s - 1e-7) for s in (1e5, 1e6, 1e7, 1e8)]
    a, b = ab.fit_alpha_beta(pts)
    assert a >= 0 and b > 0
    assert b == pytest.approx(BETA, rel=0.05)


def test_fit_needs_two_points_with_several_ranks():
    with pytest.raises(ValueError):
        ab.fit_alpha_beta([(2, 8, 1e-6), (1, 8, 1e-6)])


def test_fusion_packs_consecutive_tensors_up_to_the_threshold():
    assert ab.fuse([10, 20, 30, 40], 60) == [60, 40]
    assert ab.fuse([10, 20, 30, 40], 0) == [10, 20, 30, 40]  # threshold 0 = fusion off
    assert ab.fuse([100], 60) == [100]  # a tensor above the threshold goes alone
    assert sum(ab.fuse(list(range(1, 50)), 64)) == sum(range(1, 50))


def test_efficiency_by_hand():
    # 0.1 s of compute, one 100 MB gradient, no latency, 1 GB/s: at n=2 the ring moves
    # 100 MB in 0.1 s. No overlap: 0.1 / 0.2 = 50%. Overlap hides 2/3 of the step.
    w = ab.Workload("w", 0.1, [1e8])
    assert ab.efficiency(w, 1, 0.0, 1e-9, "fusion, no overlap") == 1.0
    assert ab.efficiency(w, 2, 0.0, 1e-9, "fusion, no overlap") == pytest.approx(0.5)
    assert ab.efficiency(w, 2, 0.0, 1e-9, "fusion + overlap") == pytest.approx(
        0.1 / (0.1 + 0.1 / 3)
    )


def test_latency_makes_fusion_matter_at_scale():
    w = ab.Workload.uniform("many", 0.3, 44.5e6, 314)
    n = 512
    no_fusion = ab.efficiency(w, n, 5e-6, 1 / 2.8e9, "no fusion, no overlap")
    fusion = ab.efficiency(w, n, 5e-6, 1 / 2.8e9, "fusion, no overlap")
    overlap = ab.efficiency(w, n, 5e-6, 1 / 2.8e9, "fusion + overlap")
    assert no_fusion < fusion <= overlap <= 1.0
    # 314 tensors x 2·511 steps x 5 µs = 1.6 s of latency alone against a 0.3 s step
    assert no_fusion < 0.2


def test_projection_is_monotone_in_ranks():
    w = ab.Workload("w", 0.05, [4e6] * 10)
    proj = ab.project([w], 5e-6, 1 / 2.8e9)
    assert proj["ranks"][0] == 1
    for effs in proj["models"]["w"].values():
        assert effs[0] == 1.0
        assert all(a >= b - 1e-12 for a, b in zip(effs, effs[1:]))


def test_published_check_has_every_figure_and_mode():
    rows = ab.validate_published()
    assert {(r["model"], r["ranks"]) for r in rows} >= {("ResNet-101", 512), ("VGG-16", 512)}
    for r in rows:
        assert set(r["predicted"]) == set(ab.MODES)
        assert all(0 < v <= 1 for v in r["predicted"].values())
        lo, hi = min(r["predicted"].values()), max(r["predicted"].values())
        assert r["bracketed"] == (lo - 1e-9 <= r["published"] <= hi + 1e-9)


def test_crossover():
    w = ab.Workload("w", 0.01, [4e8])
    n = ab.crossover_ranks(w, 0.0, 1e-9, "fusion, no overlap", target=0.9)
    assert n == 2  # 0.4 s of communication against 0.01 s of compute
    assert (
        ab.crossover_ranks(ab.Workload("tiny", 1.0, [4.0]), 0.0, 1e-9, "fusion, no overlap") is None
    )


def test_implied_step_inverts_efficiency():
    w = ab.Workload.uniform("vgg", 0.25, 138e6, 32)
    a, b = ab.NETWORKS["25GbE-RoCE"]["alpha"], ab.NETWORKS["25GbE-RoCE"]["beta"]
    for mode in ("fusion, no overlap", "fusion + overlap"):
        step = ab.implied_step(w, 512, a, b, mode, 0.68)
        back = ab.efficiency(ab.Workload("vgg", step, w.tensor_bytes), 512, a, b, mode)
        assert back == pytest.approx(0.68, rel=1e-6)
    # overlap hides communication, so it reaches 68% with a shorter step
    assert ab.implied_step(w, 512, a, b, "fusion + overlap", 0.68) < ab.implied_step(
        w, 512, a, b, "fusion, no overlap", 0.68
    )
    assert ab.implied_step(w, 512, a, b, "fusion, no overlap", 1.5) is None


def test_time_to_accuracy_reads_hpctrain_epochs_and_ranks_the_methods(tmp_path):
    """The convergence section's arithmetic: time since the first step (the summary's
    time minus its elapsed), the first epoch at the target, 'not reached' otherwise."""
    import json

    from benchmarks.sections import convergence

    records = [
        {"event": "epoch", "epoch": 0, "time": 1010.0, "val_accuracy": 0.75},
        {"event": "epoch", "epoch": 1, "time": 1020.0, "val_accuracy": 0.81},
        {"event": "summary", "time": 1021.0, "elapsed_sec": 21.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    epochs = convergence._epochs_of_hpctrain(tmp_path)
    assert [e["seconds"] for e in epochs] == [10.0, 20.0] and epochs[1]["epoch"] == 2

    def row(name, epochs):
        hit = next((e for e in epochs if e["val_accuracy"] >= 0.8), None)
        return {"name": name, "label": name, "ok": True, "epochs": epochs, "reached": hit}

    slow = [{"epoch": 1, "seconds": 30.0, "val_accuracy": 0.79}]
    data = {
        "plan": {"epochs": 2, "hidden": [8], "target": 0.8},
        "links": [{"link": "1gbit", "rows": [row("dense", epochs), row("topk", slow)]}],
    }
    text = convergence.markdown(data, None)
    assert "| 1gbit | dense | 20.0 | 2 | 1.00x | 0.8100 | 20.0 |" in text
    assert "| 1gbit | topk | not reached |" in text
