"""PNG figures for the report (matplotlib, no display needed).

Why separate: the sections stay readable as measurement code, and a missing matplotlib
only loses the pictures, never the numbers.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"hpctrain": "tab:blue", "raw_horovod": "tab:orange", "mpi4py": "tab:green"}


def _rank_axis(ax, ranks) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ranks))
    ax.set_xticklabels([str(r) for r in ranks])
    ax.minorticks_off()


def _save(fig, out: Path, name: str) -> str:
    path = out / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return name


def scaling(data, out: Path, labels: dict) -> list[str]:
    """Per backend: total img/s and efficiency vs ranks, one row per model."""
    files = []
    rows = data["rows"]
    for backend in data["plan"]["backends"]:
        models = data["plan"]["models"]
        fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.4 * len(models)), squeeze=False)
        for i, model in enumerate(models):
            ax_t, ax_e = axes[i]
            cores = None
            for kind, label in labels.items():
                pts = [
                    r
                    for r in rows
                    if (r["contender"], r["backend"], r["model"]) == (kind, backend, model)
                    and r["total"]
                ]
                pts.sort(key=lambda r: r["np"])
                if not pts:
                    continue
                xs = [r["np"] for r in pts]
                ax_t.errorbar(
                    xs,
                    [r["total"]["mean"] for r in pts],
                    yerr=[r["total"]["conf"] for r in pts],
                    marker="o",
                    capsize=3,
                    color=COLORS.get(kind),
                    label=label,
                )
                eff = [r for r in pts if r.get("efficiency")]
                ax_e.errorbar(
                    [r["np"] for r in eff],
                    [100 * r["efficiency"]["mean"] for r in eff],
                    yerr=[100 * r["efficiency"]["conf"] for r in eff],
                    marker="o",
                    capsize=3,
                    color=COLORS.get(kind),
                    label=label,
                )
                over = [r["np"] for r in pts if r["oversubscribed"]]
                if over:
                    cores = min(over)
            for ax in (ax_t, ax_e):
                _rank_axis(ax, data["plan"]["ranks"])
                ax.set_xlabel("ranks (1 thread each)")
                ax.grid(True, alpha=0.3)
                if cores:
                    ax.axvspan(cores / 1.2, cores * 1.2, color="red", alpha=0.08)
                    ax.text(
                        cores,
                        0.03,
                        "oversubscribed",
                        ha="center",
                        va="bottom",
                        fontsize=8,
                        color="darkred",
                        transform=ax.get_xaxis_transform(),
                    )
            ax_t.set_ylabel("total img/s")
            ax_t.set_title(f"{backend} {model}: throughput")
            ax_e.set_ylabel("weak-scaling efficiency %")
            ax_e.axhline(90, color="gray", ls=":", lw=1)
            ax_e.set_ylim(0, 110)
            ax_e.set_title(f"{backend} {model}: efficiency T(N)/(N·T(1))")
            ax_t.legend(fontsize=8)
        files.append(_save(fig, out, f"scaling_{backend}.png"))
    return files


def busbw(data, out: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for res in data["results"]:
        for pieces, ls in ((1, "-"), (64, "--")):
            pts = [r for r in res["rows"] if r["tensors"] == pieces]
            if not pts:
                continue
            label = res["label"] + (" x64 tensors" if pieces > 1 else "")
            ax.plot(
                [r["bytes"] for r in pts],
                [r["busbw"] / 1e9 for r in pts],
                ls=ls,
                marker=".",
                label=label,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"Allreduce bus bandwidth, np={data['np']} (shared memory)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return [_save(fig, out, "allreduce_busbw.png")]


def projection(data, out: Path) -> list[str]:
    files = []
    for i, (name, proj) in enumerate(data["projections"].items()):
        models = list(proj["models"])
        if not models:
            continue
        fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
        for ax, model in zip(axes[0], models):
            for mode, effs in proj["models"][model].items():
                ax.plot(proj["ranks"], [100 * e for e in effs], marker=".", label=mode)
            _rank_axis(ax, [r for r in proj["ranks"] if r in (1, 4, 16, 64, 256, 512)])
            ax.set_ylim(0, 105)
            ax.axhline(90, color="gray", ls=":", lw=1)
            ax.set_xlabel("ranks")
            ax.set_ylabel("projected efficiency %")
            ax.set_title(model, fontsize=10)
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Weak-scaling projection: {name}", fontsize=11)
        files.append(_save(fig, out, f"projection_{i}.png"))
    return files


def published_check(rows: list[dict], out: Path) -> list[str]:
    """The model's no-overlap..overlap range per published Horovod figure, and the figure."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = []
    for i, r in enumerate(rows):
        p = r["predicted"]
        lo, hi = p["fusion, no overlap"], p["fusion + overlap"]
        ax.plot(
            [i, i],
            [100 * lo, 100 * hi],
            color="tab:blue",
            lw=6,
            alpha=0.5,
            label="model: fusion, no overlap .. + overlap" if i == 0 else None,
        )
        ax.plot(i, 100 * r["published"], "r*", ms=12, label="published" if i == 0 else None)
        labels.append(f"{r['model']}\n{r['ranks']} {r['network']}")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("efficiency %")
    ax.set_ylim(0, 105)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("α–β model vs Horovod's published scaling (assumed P100 step times)")
    return [_save(fig, out, "projection_published.png")]
