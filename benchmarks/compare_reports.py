"""Compare two `make bench` reports side by side: the scaling section's hpctrain/contender
ratios and the exchange section's dense/method step ratios, each marked `ok` when the new
ratio is within the reference's spread (its 95% interval; at least 10% for the exchange).

    python benchmarks/compare_reports.py REFERENCE/results.json NEW/results.json

Why: "the CPU path keeps today's speed" is a claim about ratios measured on a shared
2-core machine, where whole runs move by 10-20%; a ratio outside the spread says which
side moved (the per-rank figures are in each report).
"""

from __future__ import annotations

import json
import sys


def _sections(path: str) -> dict:
    with open(path) as f:
        return json.load(f)["sections"]


def scaling_ratios(sections: dict) -> dict:
    """(backend, model, np, contender) -> (ratio, relative spread) of hpctrain over it."""
    rows = {
        (r["backend"], r["model"], r["np"], r["contender"]): r["per_rank"]
        for r in sections["scaling"]["data"]["rows"]
    }
    out = {}
    for (b, m, n, c), mine in rows.items():
        if c != "hpctrain":
            continue
        for (b2, m2, n2, c2), other in rows.items():
            if (b2, m2, n2) == (b, m, n) and c2 != "hpctrain":
                spread = (
                    (mine["conf"] / mine["mean"]) ** 2 + (other["conf"] / other["mean"]) ** 2
                ) ** 0.5
                out[(b, m, n, c2)] = (mine["mean"] / other["mean"], spread)
    return out


def exchange_ratios(sections: dict) -> dict:
    """(link, model, method) -> (dense step / its step, relative spread, its step in s)."""
    out = {}
    for link in sections["exchange"]["data"]["links"]:
        rows = {r["name"]: r for r in link["rows"] if r.get("ok") and "step" in r}
        dense = rows.get("dense")
        for name, r in rows.items():
            if dense is not None:
                step = r["step"]
                ratio = dense["step"]["mean"] / step["mean"]
                out[(link["link"], link["model"], name)] = (
                    ratio,
                    step["conf"] / step["mean"],
                    step["mean"],
                )
    return out


def main(reference: str, new: str) -> None:
    ref, cur = _sections(reference), _sections(new)
    if "scaling" in ref and "scaling" in cur:  # a report may hold some sections only
        print("scaling: hpctrain / contender, per-rank samples/s (reference -> new)")
        old, now = scaling_ratios(ref), scaling_ratios(cur)
        for key in sorted(set(old) & set(now)):
            (a, spread), (b, _) = old[key], now[key]
            verdict = "ok" if abs(b - a) <= spread * a else "OUTSIDE"
            print(f"  {key}: {a:.2f} -> {b:.2f} (+-{spread * a:.2f}) {verdict}")
    if "exchange" not in ref or "exchange" not in cur:
        return
    print("exchange: dense step / method step (reference -> new), step in ms")
    old, now = exchange_ratios(ref), exchange_ratios(cur)
    for key in sorted(set(old) & set(now)):
        (a, spread, s0), (b, _, s1) = old[key], now[key]
        verdict = "ok" if abs(b - a) <= max(spread, 0.1) * a else "OUTSIDE"
        print(f"  {key}: {a:.2f} -> {b:.2f}, {s0 * 1e3:.1f} -> {s1 * 1e3:.1f} ms {verdict}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
