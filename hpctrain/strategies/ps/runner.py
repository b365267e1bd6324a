"""`strategy: parameter_server`: roles, data, the serve/train loops, the final report.

The last `ps.servers` ranks become servers and the rest workers (one `world.split`).
Every rank derives the same shard plan from the zoo's canonical parameter names and
shapes; servers start from the zoo's numpy initial weights, so no framework is loaded
on them. Worker w reads exactly the rows data-parallel rank w of a `workers`-rank job
reads (the same `ShardedTrainData`), which is what makes sync mode comparable with
allreduce training step for step. At the end the servers broadcast their shards, the
workers evaluate, rank 0 (worker 0) writes metrics.jsonl and a final HDF5 checkpoint.

Checkpoints use the data-parallel trainer's names and layout (`ckpt-<step>.h5`,
`/model/<canonical name>`, `/optimizer/<slot>/<name>`, trainer step/epoch/position), so
`hpctrain ckpt verify` reads them and `hpctrain train --resume FILE` continues from one
with data parallelism (and a data-parallel checkpoint resumes here). Sync mode saves on
the `checkpoint:` policy at a step every rank agrees on (the wishes travel in the push
and reply headers, see protocol.py) and resumes bit for bit; async/bounded save at the
end of the run and when preempted. On preemption (SIGUSR1/SIGTERM on any rank) every
worker stops after its next exchange, the run saves, and rank 0 requeues the job.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ... import runtime
from ...backends import BACKENDS
from ...backends.base import OPTIMIZER_SLOTS
from ...checkpoint import Checkpointer, CheckpointPolicy
from ...checkpoint.reader import check_compatible
from ...checkpoint.rng import (
    capture_process_rng,
    restore_process_rng,
    rng_from_bytes,
    rng_to_bytes,
)
from ...checkpoint.session import load_agreed
from ...data import ShardedTrainData, iterate_val, prepare_dataset
from ...errors import CheckpointError, ConfigError
from ...metrics import MetricsWriter
from ...models import zoo
from ...runtime.preemption import Preemption
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
    """Same surface as Trainer: `(cfg, run_dir, verbose, resume)`, then `fit() -> summary`."""

    def __init__(
        self,
        cfg,
        run_dir: str | Path | None = None,
        verbose: bool = False,
        resume: str | None = None,
    ):
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
        # every tensor a data-parallel checkpoint holds (parameters and buffers), in order
        self.model_shapes = OrderedDict((k, tuple(v.shape)) for k, v in init.items())
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
        self.policy = CheckpointPolicy.from_config(cfg, self.run_dir)
        self.checkpointer = Checkpointer(self.policy, is_writer=w.is_root)
        if self.policy.enabled and cfg.ps["mode"] != "sync" and self.policy.every_steps:
            log.warning(
                "ps.mode=%s: checkpoints are written at the end of the run (and on "
                "preemption) only; checkpoint.every_steps needs ps.mode=sync",
                cfg.ps["mode"],
            )
        self.start = (0, 0, 0)  # (step, epoch, position)
        self.server_state = None  # a server's restored shard state
        self.resumed_from = self._resume(resume)
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
        pre = Preemption().install()
        preempted = False
        try:
            if self.is_server:
                self.server = Server(
                    w, self.index, list(range(self.n_workers)), self.params, cfg, self.lr_of,
                    preemption=pre, on_checkpoint=lambda _s: self._save_in_loop(),
                )  # fmt: skip
                if self.server_state is not None:
                    self.server.opt.load(self.server_state["opt"])
                    self.server.version = self.server_state["version"]
                stats = self.server.run()
                preempted = bool(self.server.sticky_flags & P.FLAG_PREEMPT) or pre.requested
            else:
                self.worker = Worker(
                    w,
                    self.index,
                    self.server_ranks,
                    self.plan,
                    self.model,
                    self.data,
                    cfg,
                    self.total_steps,
                    self._on_step,
                    start=self.start,
                    wants_save=lambda step, end: self.policy.due(step, epoch_end=end),
                    preemption=pre,
                    on_checkpoint=lambda wk: self._save_in_loop(wk),
                )
                stats = self.worker.run()
                preempted = self.worker.preempted
            # Finished ranks (and a worker a test hook silenced) wait here without spinning.
            P.wait_all(w.MPI, [w.comm.Ibarrier()], P.Backoff(0.01))
            elapsed = time.perf_counter() - t0
            preempted = w.any_flag(preempted, "agree on preemption")
            final = self._final_weights()
            result = {} if preempted else self._evaluate(final)
            everyone = w.gather_object(stats, what="parameter server statistics")
            workers = [s for s in everyone if "worker" in s] if w.is_root else []
            position = self._position_of(self.worker) if not self.is_server else None
            step, epoch, pos = w.bcast_object(
                (max(s["steps"] for s in workers), *position) if w.is_root else None,
                what="agree on the final step",
            )
            summary = None
            if w.is_root:
                summary = self._report(everyone, result, elapsed)
                summary["resumed_from"] = self.resumed_from
                summary["preempted"] = preempted
            metrics = {k: v for k, v in result.items() if k in ("val_loss", "val_accuracy")}
            self.checkpointer.maybe_save(
                step,
                lambda: self._collect(step, epoch, pos, metrics, average_buffers=False),
                final=True,
                agree=lambda due: due,  # the same policy state on every rank
            )
            path = self.checkpointer.wait()
            if preempted and w.is_root:
                log.warning("preempted: stopped at step %d, checkpoint %s", step, path)
                if path is not None and pre.requeue():
                    log.warning("job requeued: it resumes from this checkpoint (--resume auto)")
        finally:
            pre.uninstall()
        self.metrics.close()
        return w.bcast_object(summary, what="parameter server summary")

    @staticmethod
    def _position_of(worker) -> tuple[int, int]:
        return (worker.epoch, worker.position)

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
        buffers = self._average_buffers()  # BatchNorm statistics stay per worker
        if self.is_server:
            return None
        self.model.set_params(full)
        self.final_weights = {**full, **buffers}
        return self.final_weights

    def _average_buffers(self) -> dict[str, np.ndarray]:
        """Workers average their buffers and keep the mean (every rank calls this: the
        watchdog's guard is entered by all ranks; servers return {})."""
        w = self.world
        buffers = {} if self.is_server else self.model.get_buffers()
        with w.watchdog.guard("parameter server: average buffers"):
            for v in buffers.values():
                self.role_comm.Allreduce(w.MPI.IN_PLACE, v, op=w.MPI.SUM)
                v /= self.n_workers
        if buffers:
            self.model.set_buffers(buffers)
        return buffers

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

    # --- checkpoints -----------------------------------------------------------------
    def _save_in_loop(self, worker: Worker | None = None) -> None:
        """Sync mode, at a step whose replies carried FLAG_SAVE: every rank saves."""
        w = self.world
        step = worker.stats["steps"] if worker is not None else None
        step = w.bcast_object(step if w.is_root else None, what="agree on the checkpoint step")
        epoch, pos = w.bcast_object(
            self._position_of(worker) if w.is_root else None, what="agree on the data position"
        )
        self.checkpointer.maybe_save(
            step, lambda: self._collect(step, epoch, pos, {}), agree=lambda _due: True
        )

    def _collect(self, step, epoch, position, metrics, average_buffers=True) -> dict | None:
        """Every rank: servers send their shards (parameters, slots, version) to rank 0,
        workers average BatchNorm buffers (as the data-parallel trainer does at a save)
        and their random states; rank 0 returns save()'s arguments, the others None."""
        w = self.world
        slot_names = OPTIMIZER_SLOTS[self.cfg.optimizer["name"]]
        if average_buffers:
            buffers = self._average_buffers()
        else:
            buffers = {} if self.is_server else self.model.get_buffers()
        rng = capture_process_rng() if not self.is_server else {}
        if not self.is_server and self.backend == "torch":
            import torch

            rng["torch"] = torch.get_rng_state().numpy().copy()
        gathered = w.gather_bytes(rng_to_bytes(rng), what="gather random states")
        full = {k: np.zeros(v, np.float32) for k, v in self.shapes.items()}
        slots = {
            n: {k: np.zeros(v, np.float32) for k, v in self.shapes.items()} for n in slot_names
        }
        meta = {}
        tag = P.TAG_CTRL + 100
        # one guard every rank enters (the watchdog counts guards per rank)
        with w.watchdog.guard("parameter server: gather shards for a checkpoint"):
            for s, root in enumerate(self.server_ranks):
                if self.is_server and self.index == s:
                    opt = self.server.opt
                    info = np.array([self.server.version, opt.step], np.int64)
                    w.comm.Send(info, dest=0, tag=tag)
                    w.comm.Send(self.params, dest=0, tag=tag)
                    for n in slot_names:
                        w.comm.Send(opt.slots[n], dest=0, tag=tag)
                elif w.is_root:
                    info = np.empty(2, np.int64)
                    buf = np.empty(self.plan.server_size(s), np.float32)
                    w.comm.Recv(info, source=root, tag=tag)
                    w.comm.Recv(buf, source=root, tag=tag)
                    self.plan.scatter(s, buf, full)
                    for n in slot_names:
                        w.comm.Recv(buf, source=root, tag=tag)
                        self.plan.scatter(s, buf, slots[n])
                    meta[s] = (int(info[0]), int(info[1]))
        if not w.is_root:
            return None
        model = {**full, **buffers}
        state = {f"model/{k}": model[k] for k in self.model_shapes}
        for n in slot_names:
            state.update({f"optimizer/{n}/{k}": v for k, v in slots[n].items()})
        if self.cfg.optimizer["name"] == "adam":
            state["optimizer/step"] = np.array(max(u for _, u in meta.values()), np.int64)
        trainer = {
            "step": int(step),
            "epoch": int(epoch),
            "position": int(position),
            # the data-parallel equivalent: worker w reads what DP rank w of n_workers reads
            "world_size": self.n_workers,
            "global_batch": self.data.global_batch,
        }
        for s, (version, updates) in sorted(meta.items()):
            trainer[f"ps_version_{s}"] = version
            trainer[f"ps_updates_{s}"] = updates
        return {
            "state": state,
            "trainer_state": trainer,
            # keyed by worker index (= the data-parallel rank reading the same rows)
            "rng_by_rank": {r: rng_from_bytes(gathered[r]) for r in range(self.n_workers)},
            "attrs": {
                "backend": self.cfg.backend,
                "strategy": "parameter_server",
                "ps_mode": self.cfg.ps["mode"],
                "ps_servers": self.n_servers,
                "ps_workers": self.n_workers,
                "world_size": self.world.size,
                "config_yaml": self.cfg.to_yaml(),
            },
            "metrics": metrics,
        }

    def _resume(self, resume: str | None) -> str | None:
        """Servers take their shard of parameters, slots and version; workers their data
        position, buffers and random state. Any rank's problem stops every rank."""
        ckpt = load_agreed(self.world, self.policy, resume, self._restore)
        if ckpt is None:
            return None
        chosen = str(ckpt.path)
        self.policy.mark_saved(self.start[0])
        log.info("resumed from %s at step %d (epoch %d, sample %d)", chosen, *self.start)
        return chosen

    def _restore(self, ckpt) -> None:
        mismatch = check_compatible(ckpt.state, self.model_shapes)
        if mismatch:
            raise CheckpointError(
                f"{ckpt.path}: does not fit this model (wrong architecture or options?): "
                f"{mismatch.message()}"
            )
        missing = [k for k in ("step", "epoch", "position") if k not in ckpt.trainer]
        if missing:
            raise CheckpointError(f"{ckpt.path}: trainer state lacks {missing}")
        tr = ckpt.trainer
        self.start = (int(tr["step"]), int(tr["epoch"]), int(tr["position"]))
        weights = ckpt.model_weights()
        kind = self.cfg.optimizer["name"]
        if self.is_server:
            slot_names = OPTIMIZER_SLOTS[kind]
            absent = [
                f"optimizer/{n}/..."
                for n in slot_names
                if any(f"optimizer/{n}/{k}" not in ckpt.state for k in self.shapes)
            ]
            if absent:
                raise CheckpointError(
                    f"{ckpt.path}: optimizer state {', '.join(absent)} missing (saved with "
                    f"another optimizer than optimizer.name={kind}?)"
                )
            self.plan.gather(self.index, weights, self.params)
            size = self.plan.server_size(self.index)
            opt = {
                n: self.plan.gather(
                    self.index,
                    {k: ckpt.state[f"optimizer/{n}/{k}"] for k in self.shapes},
                    np.zeros(size, np.float32),
                )
                for n in slot_names
            }
            step = self.start[0]
            updates = tr.get(f"ps_updates_{self.index}")
            if updates is None:  # a data-parallel checkpoint: one update per step
                updates = int(ckpt.state.get("optimizer/step", step))
            opt["step"] = np.array(int(updates), np.int64)
            self.server_state = {
                "opt": opt,
                "version": int(tr.get(f"ps_version_{self.index}", step)),
            }
        else:
            buffers = {k: weights[k] for k in self.model.get_buffers()}
            if buffers:
                self.model.set_buffers(buffers)
            saved_workers = int(tr.get("world_size", -1))
            if saved_workers == self.n_workers and self.index in ckpt.rng:
                rng = ckpt.rng[self.index]
                restore_process_rng(rng)
                if self.backend == "torch" and "torch" in rng:
                    import torch

                    torch.set_rng_state(torch.from_numpy(np.asarray(rng["torch"], np.uint8)))


def _keys_to_str(hist: dict) -> dict:
    return {str(k): v for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))}
