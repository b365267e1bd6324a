"""The parameter server's end-of-run report: per-server and per-worker records in
metrics.jsonl and the summary's PS part (rank 0, from every rank's statistics)."""

from __future__ import annotations


def report(metrics, facts: dict, everyone: list[dict], result: dict, elapsed: float) -> dict:
    """Per-server and per-worker records in metrics.jsonl; the summary's PS part."""
    servers = [s for s in everyone if "server" in s]
    workers = [s for s in everyone if "worker" in s]
    for s in servers:
        secs = max(s["seconds"], 1e-9)
        metrics.write(
            "ps_server",
            server=s["server"],
            rank=s["rank"],
            version=s["version"],
            pushes_per_sec=s["pushes"] / secs,
            pulls_per_sec=s["pulls"] / secs,
            bytes_in_per_sec=s["bytes_in"] / secs,
            bytes_out_per_sec=s["bytes_out"] / secs,
            cpu_share=s["cpu_seconds"] / secs,
            rejected=s["rejected"],
            staleness_accepted=_keys_to_str(s["staleness_accepted"]),
            staleness_rejected=_keys_to_str(s["staleness_rejected"]),
            scale_sum=s["scale_sum"],
            pushes_per_worker=s["pushes_per_worker"],
            dropped=s["dropped"],
            elements=s["elements"],
        )
    for s in workers:
        metrics.write(
            "ps_worker",
            worker=s["worker"],
            rank=s["rank"],
            backend=s["backend"],
            step=s["steps"],
            samples_per_sec=s["samples_per_sec"],
            rejected=s["rejected"],
            wait_share=s["wait_seconds"] / max(s["seconds"], 1e-9),
            stopped=s["silent"] or s["stopped_by_server"],
        )
    accepted, rejected = {}, {}
    for s in servers:
        for src, dst in (
            (s["staleness_accepted"], accepted),
            (s["staleness_rejected"], rejected),
        ):
            for k, n in src.items():
                dst[k] = dst.get(k, 0) + n
    samples = sum(s["samples"] for s in workers)
    summary = {
        "strategy": "parameter_server",
        **facts,  # mode, servers, workers, world_size, model, steps
        "backends": [s["backend"] for s in workers],
        "worker_steps": [s["steps"] for s in workers],
        "versions": [s["version"] for s in servers],
        "pushes": sum(s["pushes"] for s in servers),
        "rejected": sum(s["rejected"] for s in servers),
        "staleness_accepted": _keys_to_str(accepted),
        "staleness_rejected": _keys_to_str(rejected),
        "scale_sum": sum(s["scale_sum"] for s in servers),
        "dropped_workers": sorted({d for s in servers for d in s["dropped"]}),
        "samples_per_sec": samples / elapsed if elapsed > 0 else None,
        "samples_per_sec_per_rank": samples / elapsed / facts["world_size"]
        if elapsed > 0
        else None,
        "samples_per_sec_per_worker": [s["samples_per_sec"] for s in workers],
        "server_cpu_share": [s["cpu_seconds"] / max(s["seconds"], 1e-9) for s in servers],
        **result,
    }
    return summary


def _keys_to_str(hist: dict) -> dict:
    return {str(k): v for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))}
