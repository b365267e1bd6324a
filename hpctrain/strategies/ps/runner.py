"""`strategy: parameter_server`: roles, data, the serve/train loops, the final report.

The last `ps.servers` ranks become servers and the rest workers (one `world.split`).
Every rank derives the same shard plan from the zoo's canonical parameter names and
shapes; servers start from the zoo's numpy initial weights, so no framework is loaded
on them. Worker w reads exactly the rows data-parallel rank w of a `workers`-rank job
reads (the same `ShardedTrainData`), which is what makes sync mode comparable with
allreduce training step for step. At the end the servers broadcast their shards, the
workers evaluate, rank 0 (worker 0) writes metrics.jsonl and a final HDF5 checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ... import runtime
from ...backends import BACKENDS
from ...data import ShardedTrainData, iterate_val, prepare_dataset
from ...errors import ConfigError
from ...metrics import MetricsWriter
from ...models import zoo
from ...schedule import lr_at
from ...trainer import default_run_dir, prepare_process
from . import protocol as P
from .server import Server
from .sharding import plan_shards
from .worker import Worker

log = logging.getLogger("hpctrain.ps")


def config_problems(cfg, world_size: int) -> str | None:
    """What makes this configuration impossible for the parameter server (or None)."""
    problems = []
    servers = cfg.ps["servers"]
    if servers >= world_size:
        problems.append(
            f"ps.servers={servers} leaves no worker in a job of {world_size} rank(s): "
            f"launch more ranks than servers (e.g. mpirun -np {servers + 2})"
        )
    if not zoo.is_zoo_model(cfg.model["name"]):
        problems.append(
            f"model.name={cfg.model['name']}: the parameter server trains zoo models only "
            "(mlp, cnn, resnet, transformer): servers build the parameter layout without a "
            "framework"
        )
    if cfg.train["clip_norm"] is not None:
        problems.append("train.clip_norm is not supported with the parameter server")
    if cfg.train["compression"] != "none":
        problems.append("train.compression: gradients travel as float32 with the parameter server")
    if cfg.data["source"] == "benchmark":
        problems.append("data.source=benchmark is not supported with the parameter server")
    for b in cfg.ps["backends"] or []:
        if b not in BACKENDS:
            problems.append(f"ps.backends: {b!r} is not one of {', '.join(BACKENDS)}")
    return "; ".join(problems) or None


def _make_model(backend: str, cfg, inp, threads: int, rank: int):
    if backend == "torch":
        from ...backends.torch_worker import TorchWorker

        return TorchWorker(cfg, inp, threads, rank)
    from ...backends.tensorflow_worker import TensorFlowWorker

    return TensorFlowWorker(cfg, inp, threads, rank)


class ParameterServerRunner:
    """Same surface as Trainer: `(cfg, run_dir, verbose)`, then `fit() -> summary`."""

    def __init__(self, cfg, run_dir: str | Path | None = None, verbose: bool = False):
        self.cfg = cfg
        w = self.world = prepare_process(cfg)
        runtime.setup_logging(w.rank, w.size, verbose)
        w.agree(config_problems(cfg, w.size), error_type=ConfigError)
        self.n_servers = cfg.ps["servers"]
        self.n_workers = w.size - self.n_servers
        self.is_server = w.rank >= self.n_workers
        self.index = w.rank - self.n_workers if self.is_server else w.rank
        self.server_ranks = list(range(self.n_workers, w.size))
        self.role_comm = w.split("ps-role", 1 if self.is_server else 0)
        chosen = str(run_dir) if run_dir is not None else str(default_run_dir(cfg))
        self.run_dir = Path(w.bcast_object(chosen, what="agree on the run directory"))
        if w.is_root:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        self.dataset = prepare_dataset(cfg, w, self.run_dir)
        inp = self.dataset.input_spec
        tcfg = cfg.train
        layers = zoo.build_layers(cfg.model, inp)
        init = zoo.init_weights(layers, tcfg["seed"])
        self.shapes = OrderedDict((n, init[n].shape) for n in zoo.param_names(layers))
        self.plan = plan_shards(self.shapes, self.n_servers, cfg.ps["chunk_bytes"])
        global_batch = tcfg["batch_size"] * tcfg["grad_accum"] * self.n_workers
        self.steps_per_epoch = self.dataset.train_size // global_batch
        total = self.steps_per_epoch * tcfg["epochs"]
        self.total_steps = min(total, tcfg["max_steps"]) if tcfg["max_steps"] else total
        w.agree(
            None
            if self.steps_per_epoch
            else f"{self.dataset.train_size} training samples do not fill one global batch of "
            f"{global_batch} ({self.n_workers} workers)",
            error_type=ConfigError,
        )
        self.metrics = MetricsWriter(
            self.run_dir, w.is_root, cfg.metrics["jsonl"], cfg.metrics["tensorboard"]
        )
        threads = cfg.runtime["threads"] or runtime.threads_per_rank(w.local_size)[0]
        self.model, self.data = None, None
        error = None
        if self.is_server:
            flat = np.zeros(self.plan.server_size(self.index), np.float32)
            self.params = self.plan.gather(self.index, init, flat)
        else:
            backends = cfg.ps["backends"] or [cfg.backend]
            self.backend = backends[self.index % len(backends)]
            self.model = _make_model(self.backend, cfg, inp, threads, w.rank)
            if dict(self.model.param_shapes()) != dict(self.shapes):
                error = f"{self.backend} model's parameters differ from the zoo's layout"
            self.data = ShardedTrainData(
                self.dataset,
                self.index,
                self.n_workers,
                tcfg["batch_size"],
                tcfg["grad_accum"],
                tcfg["seed"],
                cfg.data["prefetch"],
            )
        w.agree(error)
        log.info(
            "parameter server (%s): %d server(s), %d worker(s), %d tensors in %d chunks, "
            "%d steps per worker, run dir %s",
            cfg.ps["mode"],
            self.n_servers,
            self.n_workers,
            len(self.shapes),
            len(self.plan.chunks),
            self.total_steps,
            self.run_dir,
        )

    def lr_of(self, version: int) -> float:
        """Sync: one version per global step; async/bounded: one per worker push."""
        if self.cfg.ps["mode"] == "sync":
            return lr_at(
                version, self.cfg.optimizer, self.n_workers, self.steps_per_epoch, self.total_steps
            )
        return lr_at(
            version // self.n_workers, self.cfg.optimizer, 1, self.steps_per_epoch, self.total_steps
        )

    def _on_step(self, worker: Worker, loss: float, accuracy: float, seconds: float) -> None:
        step = worker.stats["steps"]
        if self.world.is_root and (
            step % self.cfg.train["log_every"] == 0 or step == self.total_steps
        ):
            batch = self.cfg.train["batch_size"] * self.cfg.train["grad_accum"]
            self.metrics.write(
                "step",
                epoch=(step - 1) // self.steps_per_epoch,
                step=step,
                loss=loss,
                accuracy=accuracy,
                lr=worker.reply[0].lr,
                samples_per_sec=batch / seconds,
                versions=list(worker.versions),
                rejected=worker.stats["rejected"],
            )
            log.info(
                "worker 0 step %d/%d loss %.4f versions %s",
                step,
                self.total_steps,
                loss,
                worker.versions,
            )

    # --- the run -------------------------------------------------------------------------
    def fit(self) -> dict:
        w, cfg = self.world, self.cfg
        w.barrier("parameter server: every rank ready")
        t0 = time.perf_counter()
        if self.is_server:
            self.server = Server(
                w, self.index, list(range(self.n_workers)), self.params, cfg, self.lr_of
            )
            stats = self.server.run()
        else:
            stats = Worker(
                w,
                self.index,
                self.server_ranks,
                self.plan,
                self.model,
                self.data,
                cfg,
                self.total_steps,
                self._on_step,
            ).run()
        # Finished ranks (and a worker a test hook silenced) wait here without spinning.
        P.wait_all(w.MPI, [w.comm.Ibarrier()], P.Backoff(0.01))
        elapsed = time.perf_counter() - t0
        final = self._final_weights()
        result = self._evaluate(final)
        everyone = w.gather_object(stats, what="parameter server statistics")
        state = self._gather_state(final)
        summary = None
        if w.is_root:
            summary = self._report(everyone, result, elapsed)
            self._checkpoint(state, everyone, summary)
        self.metrics.close()
        return w.bcast_object(summary, what="parameter server summary")

    def _final_weights(self) -> dict[str, np.ndarray] | None:
        """Every server broadcasts its shard; workers assemble the full parameters."""
        w = self.world
        full = {k: np.zeros(v, np.float32) for k, v in self.shapes.items()}
        for s, root in enumerate(self.server_ranks):
            buf = (
                self.params
                if self.index == s and self.is_server
                else np.empty(self.plan.server_size(s), np.float32)
            )
            with w.watchdog.guard("parameter server: final parameters"):
                w.comm.Bcast(buf, root=root)
            self.plan.scatter(s, buf, full)
        if self.is_server:
            return None
        self.model.set_params(full)
        buffers = self.model.get_buffers()
        for v in buffers.values():  # BatchNorm statistics stay per worker: average them
            with w.watchdog.guard("parameter server: average buffers"):
                self.role_comm.Allreduce(w.MPI.IN_PLACE, v, op=w.MPI.SUM)
            v /= self.n_workers
        self.model.set_buffers(buffers)
        self.final_weights = {**full, **buffers}
        return self.final_weights

    def _evaluate(self, final) -> dict:
        sums = np.zeros(3)
        if not self.is_server and self.dataset.val_size:
            batch = max(256, self.cfg.train["batch_size"])
            for x, y in iterate_val(self.dataset, self.index, self.n_workers, batch):
                ev = self.model.evaluate(x, y)
                sums += (ev.loss_sum, ev.correct, ev.count)
        total = self.world.allreduce_array(sums, "sum", "validation metrics")
        if not total[2]:
            return {}
        return {
            "val_loss": total[0] / total[2],
            "val_accuracy": total[1] / total[2],
            "val_samples": int(total[2]),
        }

    def _gather_state(self, final) -> dict | None:
        """Optimizer slots from every server to rank 0 (buffer API, no pickle)."""
        w = self.world
        slots = {}
        for s, root in enumerate(self.server_ranks):
            opt_state = self.server.opt.state() if self.is_server and self.index == s else None
            names = sorted(k for k in (opt_state or {}) if k != "step")
            names = w.bcast_object(names, root=root, what="optimizer slot names")
            for name in names:
                buf = opt_state[name] if opt_state is not None else None
                if w.rank == root and root != 0:
                    w.comm.Send(buf, dest=0, tag=P.TAG_CTRL + 100)
                elif w.rank == 0:
                    buf = np.empty(self.plan.server_size(s), np.float32)
                    w.comm.Recv(buf, source=root, tag=P.TAG_CTRL + 100)
                if w.rank == 0:
                    full = slots.setdefault(
                        name, {k: np.zeros(v, np.float32) for k, v in self.shapes.items()}
                    )
                    self.plan.scatter(s, buf, full)
        if w.rank != 0:
            return None
        state = {f"model/{k}": v for k, v in final.items()}
        for name, arrays in slots.items():
            state.update({f"optimizer/{name}/{k}": v for k, v in arrays.items()})
        return state

    def _report(self, everyone: list[dict], result: dict, elapsed: float) -> dict:
        servers = [s for s in everyone if "server" in s]
        workers = [s for s in everyone if "worker" in s]
        for s in servers:
            secs = max(s["seconds"], 1e-9)
            self.metrics.write(
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
            self.metrics.write(
                "ps_worker",
                worker=s["worker"],
                rank=s["rank"],
                backend=s["backend"],
                step=s["steps"],
                samples_per_sec=s["samples_per_sec"],
                rejected=s["rejected"],
                wait_share=s["wait_seconds"] / max(s["seconds"], 1e-9),
                stopped=s["stopped_by_test_hook"] or s["stopped_by_server"],
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
            "mode": self.cfg.ps["mode"],
            "servers": self.n_servers,
            "workers": self.n_workers,
            "world_size": self.world.size,
            "model": self.cfg.model["name"],
            "backends": [s["backend"] for s in workers],
            "steps": self.total_steps,
            "worker_steps": [s["steps"] for s in workers],
            "versions": [s["version"] for s in servers],
            "pushes": sum(s["pushes"] for s in servers),
            "rejected": sum(s["rejected"] for s in servers),
            "staleness_accepted": _keys_to_str(accepted),
            "staleness_rejected": _keys_to_str(rejected),
            "scale_sum": sum(s["scale_sum"] for s in servers),
            "dropped_workers": sorted({d for s in servers for d in s["dropped"]}),
            "samples_per_sec": samples / elapsed if elapsed > 0 else None,
            "samples_per_sec_per_worker": [s["samples_per_sec"] for s in workers],
            "server_cpu_share": [s["cpu_seconds"] / max(s["seconds"], 1e-9) for s in servers],
            "elapsed_sec": elapsed,
            **result,
        }
        self.metrics.write("summary", epoch=None, step=self.total_steps, **summary)
        log.info("done: %s", ", ".join(f"{k}={v}" for k, v in summary.items()))
        return summary

    def _checkpoint(self, state: dict, everyone: list[dict], summary: dict) -> None:
        """Parameters, optimizer slots and server versions through hpctrain.checkpoint."""
        try:
            from ...checkpoint import writer
        except ImportError:  # pragma: no cover - the checkpoint package is optional here
            log.warning("hpctrain.checkpoint is not available: no PS checkpoint written")
            return
        servers = [s for s in everyone if "server" in s]
        if self.cfg.optimizer["name"] == "adam":
            state["optimizer/step"] = np.array(max(s["version"] for s in servers), np.int64)
        trainer = {f"ps_version_{s['server']}": int(s["version"]) for s in servers}
        trainer["step"] = int(self.total_steps)
        path = writer.save(
            self.run_dir / "checkpoints",
            int(max(s["version"] for s in servers)),
            state,
            trainer_state=trainer,
            attrs={
                "strategy": "parameter_server",
                "ps_mode": self.cfg.ps["mode"],
                "world_size": self.world.size,
                "config_yaml": self.cfg.to_yaml(),
            },
            metrics={k: summary[k] for k in ("val_loss", "val_accuracy") if k in summary},
        )
        log.info("checkpoint %s", path)


def _keys_to_str(hist: dict) -> dict:
    return {str(k): v for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))}
