"""Pipeline-parallel training (`strategy: pipeline`): P stages x D replicas over mpi4py.

The model's layer sequence is cut into P contiguous stages (by parameter count, measured
forward time, or an explicit list); the N = P x D ranks form a grid (runtime/grid.py).
Each step every replica runs m micro-batches through its stages with the GPipe or the
1F1B schedule, activations and gradients moving as raw buffers between neighbours
(pipeline/transport.py). Gradients accumulate over the m micro-batches; each stage's
D replicas average them with Horovod over the stage's own process set; each stage then
steps its optimizer once. The result equals one step of single-process training on the
whole global batch (tests/test_pipeline.py checks it to 1e-5).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import math
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .. import runtime
from ..backends.base import cross_entropy_np
from ..backends.horovod_env import apply_horovod_env
from ..checkpoint.rng import capture_process_rng, rng_to_bytes
from ..checkpoint.session import TrainerCheckpoints
from ..config import Config
from ..data import BenchmarkData, ShardedTrainData, benchmark_input_spec, iterate_val
from ..data.sharded import val_block
from ..errors import TrainingDiverged
from ..metrics import MetricsWriter, Progress
from ..models import zoo
from ..pipeline.engine import run_inference, run_step
from ..pipeline.partition import balanced_counts, check_partition, stage_bounds
from ..pipeline.schedule import bubble_theory, stage_actions
from ..pipeline.transport import StageTransport
from ..runtime.grid import pipeline_grid
from ..runtime.preemption import Preemption
from ..schedule import lr_at
from ..trainer import TrainState, default_run_dir, prepare_dataset, prepare_process

log = logging.getLogger("hpctrain.pipeline")


def model_layers(model_cfg: dict, inp: zoo.InputSpec) -> list[zoo.LayerSpec]:
    """A zoo model's layer sequence, or a user's `pkg.module:fn` returning LayerSpecs."""
    name = model_cfg["name"]
    if zoo.is_zoo_model(name):
        return zoo.build_layers(model_cfg, inp)
    module_name, fn_name = name.split(":", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    layers = fn(**{k: v for k, v in model_cfg.items() if k != "name"})
    if not (isinstance(layers, list) and all(isinstance(x, zoo.LayerSpec) for x in layers)):
        raise TypeError(
            f"model.name {name}: the pipeline needs a list of zoo.LayerSpec to cut into "
            f"stages, got {type(layers).__name__}"
        )
    return layers


class PipelineTrainer:
    """Same surface as hpctrain.Trainer: build everything in __init__, `fit()` trains."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str | Path | None = None,
        verbose: bool = False,
        layers: list[zoo.LayerSpec] | None = None,
        resume: str | None = None,
    ):
        self.cfg = cfg
        self.world = w = prepare_process(cfg)
        runtime.setup_logging(w.rank, w.size, verbose)
        pcfg, tcfg = cfg.pipeline, cfg.train
        self.stages, self.micro = pcfg["stages"], pcfg["microbatches"]
        chosen = str(run_dir) if run_dir is not None else str(default_run_dir(cfg))
        self.run_dir = Path(w.bcast_object(chosen, what="agree on the run directory"))
        if w.is_root:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(cfg.to_yaml())
        w.agree(
            None
            if tcfg["grad_accum"] == 1
            else "train.grad_accum: the pipeline accumulates over pipeline.microbatches; "
            "leave train.grad_accum at 1"
        )
        self.grid = g = pipeline_grid(w, self.stages)
        threads = cfg.runtime["threads"] or runtime.threads_per_rank(w.local_size)[0]
        b = tcfg["batch_size"]
        if cfg.data["source"] == "benchmark":
            self.dataset = None
            inp = benchmark_input_spec(cfg.data)
            steps = max(1, cfg.data["train_samples"] // (b * self.micro * g.replicas))
            # Seeded by replica: a replica's first and last stage must see the same batch.
            self.data = BenchmarkData(
                inp, b, self.micro, g.replicas, tcfg["seed"] + g.replica, steps
            )
        else:
            self.dataset = prepare_dataset(cfg, w, self.run_dir)
            inp = self.dataset.input_spec
            self.data = ShardedTrainData(
                self.dataset, g.replica, g.replicas, b, self.micro, tcfg["seed"],
                cfg.data["prefetch"] if (g.first or g.last) else 0,
            )  # fmt: skip
        self.input_spec = inp
        self.layers, problem = layers, None
        if self.layers is None:
            try:
                self.layers = model_layers(cfg.model, inp)
            except (TypeError, ValueError, ImportError, AttributeError) as exc:
                problem = str(exc)
        w.agree(problem)
        w.agree(check_partition(pcfg["partition"], len(self.layers), self.stages))
        apply_horovod_env(cfg.horovod, cfg.runtime["collective_timeout"])
        mod = importlib.import_module(
            "hpctrain.backends." + ("torch_stage" if cfg.backend == "torch" else "tensorflow_stage")
        )
        weights = zoo.init_weights(self.layers, tcfg["seed"])
        self.canonical_names = list(weights)
        self.canonical_shapes = {k: tuple(v.shape) for k, v in weights.items()}
        self.counts = self._partition(mod, weights, inp)
        start, stop = stage_bounds(self.counts)[g.stage]
        stage_cls = mod.TorchStage if cfg.backend == "torch" else mod.TensorFlowStage
        self.stage = stage_cls(
            cfg, self.layers[start:stop], weights, g.first, g.last, threads, w.rank
        )
        if g.replicas > 1:
            self.stage.attach_replicas(*mod.init_replicas(w.comm, g.stage_groups(), g.stage))
        in_shape, out_shape = self._agree_shapes(inp)
        self.link = StageTransport(
            g.pipe,
            g.stage,
            self.stages,
            None if g.first else in_shape,
            None if g.last else out_shape,
        )
        self.actions = stage_actions(pcfg["schedule"], g.stage, self.stages, self.micro)
        # Loss terms of one step on one replica: the loss is their mean (then replica mean).
        self.terms = self.micro * b * (inp.shape[0] if inp.tokens else 1)
        self.state = TrainState()
        self.backend = _StageBackend(self)  # what TrainerCheckpoints asks of a backend
        self.checkpoints = PipelineCheckpoints(self)
        self.resumed_from = self.checkpoints.resume(resume)
        self.steps_per_epoch = self.data.steps_per_epoch
        total = self.steps_per_epoch * tcfg["epochs"]
        self.total_steps = min(total, tcfg["max_steps"]) if tcfg["max_steps"] else total
        self.metrics = MetricsWriter(
            self.run_dir, w.is_root, cfg.metrics["jsonl"], cfg.metrics["tensorboard"]
        )
        log.info(
            "pipeline: %s backend, model %s, %d stage(s) %s x %d replica(s), %s schedule, "
            "%d micro-batches of %d, %d thread(s)/rank, run dir %s",
            cfg.backend, cfg.model["name"], self.stages, self.counts, g.replicas,
            pcfg["schedule"], self.micro, b, threads, self.run_dir,
        )  # fmt: skip

    # --- set-up helpers -----------------------------------------------------------
    def _partition(self, mod, weights, inp) -> list[int]:
        spec = self.cfg.pipeline["partition"]
        if isinstance(spec, list):
            return list(spec)
        if spec == "parameters":
            return balanced_counts([lay.param_count() for lay in self.layers], self.stages)
        # "time": rank 0 measures, everyone uses its numbers (one partition for all).
        costs = None
        if self.world.is_root:
            rng = np.random.default_rng(0)
            shape = (self.cfg.train["batch_size"], *inp.shape)
            x = (
                rng.integers(0, inp.classes, shape)
                if inp.tokens
                else rng.standard_normal(shape).astype(np.float32)
            )
            costs = mod.layer_forward_seconds(self.layers, weights, x)
        costs = self.world.bcast_object(costs, what="share measured layer times")
        return balanced_counts(costs, self.stages)

    def _agree_shapes(self, inp) -> tuple[tuple, tuple]:
        """Each stage learns its input shape from the previous one, once, down the pipe."""
        g, b = self.grid, self.cfg.train["batch_size"]
        with self.world.watchdog.guard("agree on pipeline message shapes"):
            if g.first:
                in_shape = (b, *inp.shape)
            else:
                in_shape = tuple(g.pipe.recv(source=g.stage - 1, tag=77))
            dtype = np.int64 if (g.first and inp.tokens) else np.float32
            probe = self.stage.infer(np.zeros((1, *in_shape[1:]), dtype=dtype))
            out_shape = (b, *probe.shape[1:])
            if not g.last:
                g.pipe.send(out_shape, dest=g.stage + 1, tag=77)
        return in_shape, out_shape

    # --- the loop ---------------------------------------------------------------
    def fit(self) -> dict:
        w, cfg, st, g = self.world, self.cfg, self.state, self.grid
        progress = Progress(
            w.is_root, self.total_steps, log, cfg.train["log_every"], cfg.metrics["progress_bar"]
        )
        t_start = time.perf_counter()
        samples_done, busy_total, wall_total, last_eval = 0, np.zeros(self.stages), 0.0, {}
        busy_wall = np.zeros(self.stages)
        preempted = None
        pre = Preemption().install()
        try:
            while st.step < self.total_steps and st.epoch < cfg.train["epochs"]:
                epoch_loss, epoch_count = 0.0, 0
                if g.first or g.last:
                    batches = self.data.iterate(st.epoch, st.position)
                else:
                    batches = itertools.repeat(None, self.data.steps_left(st.position))
                for batch in batches:
                    t0 = time.perf_counter()
                    lr = lr_at(
                        st.step, cfg.optimizer, g.replicas, self.steps_per_epoch, self.total_steps
                    )
                    save_due = self.checkpoints.due_locally(st.step + 1)
                    totals, busy, wall, flags = self._train_step(batch, lr, pre.requested, save_due)
                    dt = time.perf_counter() - t0
                    st.step += 1
                    st.position += self.data.global_batch
                    samples_done += self.data.global_batch
                    epoch_loss += totals[0]
                    epoch_count += totals[2]
                    busy_total += busy
                    busy_wall += wall
                    wall_total += dt
                    loss = totals[0] / totals[2]
                    if st.step % cfg.train["log_every"] == 0 or st.step == self.total_steps:
                        self.metrics.write(
                            "step",
                            epoch=st.epoch,
                            step=st.step,
                            loss=loss,
                            lr=lr,
                            accuracy=totals[1] / totals[2],
                            samples_per_sec=self.data.global_batch / dt,
                            samples_per_sec_per_rank=self.data.global_batch / dt / w.size,
                            stage_busy_sec=[round(float(v), 6) for v in busy],
                            stage_idle_sec=[round(float(v), 6) for v in wall - busy],
                            bubble_fraction=float(np.mean(1 - busy / wall)),
                        )
                    progress.update(st.step, f"epoch {st.epoch} loss {loss:.4f} lr {lr:.4g}")
                    if flags[0] > 0:  # a rank was signalled: every rank stops here
                        preempted = self.checkpoints.preempt(pre, progress)
                        break
                    self.checkpoints.maybe_save(st.step, agreed_due=bool(flags[1]))
                    if st.step >= self.total_steps:
                        break
                if preempted:
                    break
                epoch_done = self.data.steps_left(st.position) == 0
                if epoch_done or st.step >= self.total_steps:
                    last_eval = {"loss": epoch_loss / max(1, epoch_count)}
                    if (st.epoch + 1) % cfg.train["eval_every_epochs"] == 0 or (
                        st.step >= self.total_steps
                    ):
                        last_eval.update(self.evaluate())
                    self.metrics.write("epoch", epoch=st.epoch, step=st.step, **last_eval)
                if epoch_done:
                    st.epoch += 1
                    st.position = 0
                    self.checkpoints.maybe_save(st.step, epoch_end=True, metrics=last_eval)
            if not preempted:
                self.checkpoints.maybe_save(st.step, final=True, metrics=last_eval)
            self.checkpoints.close()
        finally:
            pre.uninstall()
            progress.close()
        elapsed = time.perf_counter() - t_start
        peaks = np.zeros(self.stages, dtype=np.int64)
        peaks[g.stage] = self.stage.peak_stash
        peaks = w.allreduce_array(peaks, "max", "pipeline peak stash")
        summary = {
            "steps": st.step,
            "epochs": st.epoch,
            "world_size": w.size,
            "backend": cfg.backend,
            "model": cfg.model["name"],
            "strategy": "pipeline",
            "stages": self.stages,
            "replicas": g.replicas,
            "schedule": cfg.pipeline["schedule"],
            "microbatches": self.micro,
            "partition": self.counts,
            "samples_per_sec": samples_done / elapsed if elapsed > 0 else None,
            "samples_per_sec_per_rank": samples_done / elapsed / w.size if elapsed > 0 else None,
            "elapsed_sec": elapsed,
            "stage_busy_sec": [float(v) for v in busy_total],
            "stage_idle_sec": [float(v) for v in busy_wall - busy_total],
            "bubble_fraction": float(np.mean(1 - busy_total / np.maximum(busy_wall, 1e-12))),
            "bubble_theory": bubble_theory(self.stages, self.micro),
            "stage_peak_microbatches": [int(v) for v in peaks],
            "resumed_from": self.resumed_from,
            "preempted": preempted,
            **last_eval,
        }
        self.metrics.write("summary", epoch=st.epoch, step=st.step, **summary)
        self.metrics.close()
        if w.is_root:
            log.info("done: %s", ", ".join(f"{k}={v}" for k, v in summary.items()))
        return summary

    def _train_step(self, batch, lr: float, preempt: bool = False, save_due: bool = False):
        """One optimizer step on this rank; returns the world's summed step numbers.

        The same allreduce carries every rank's preemption flag and time-based
        checkpoint wish (the last two values), so all ranks act at the same step."""
        g, P = self.grid, self.stages
        timing = run_step(self.stage, self.link, self.actions, batch, self.micro, 1.0 / self.terms)
        loss_sum, correct = self.stage.take_stats()
        self.stage.average_grads()
        coef = 1.0
        clip = self.cfg.train["clip_norm"]
        if clip is not None:  # the global norm spans every stage of the replica
            sq = np.array([self.stage.grad_square_sum()])
            with self.world.watchdog.guard("pipeline gradient norm"):
                g.pipe.Allreduce(self.world.MPI.IN_PLACE, sq, op=self.world.MPI.SUM)
            coef = min(float(clip) / (math.sqrt(sq[0]) + 1e-6), 1.0)
        self.stage.apply(lr, coef)
        bad = 0.0 if math.isfinite(loss_sum) else 1.0
        local = np.zeros(6 + 2 * P)
        if g.last:
            local[:4] = (0.0 if bad else loss_sum, correct, self.terms, bad)
        local[4 + g.stage] = timing.busy
        local[4 + P + g.stage] = timing.wall
        local[4 + 2 * P :] = (float(preempt), float(save_due))
        totals = self.world.allreduce_array(local, "sum", "pipeline step metrics")
        if totals[3] > 0 and self.cfg.train["nan_check"]:
            exc = TrainingDiverged(
                f"loss became NaN/inf at step {self.state.step + 1} (epoch {self.state.epoch}): "
                "lower optimizer.lr, set train.clip_norm, or check the data for NaN/inf values"
            )
            exc.agreed = True
            raise exc
        busy = totals[4 : 4 + P] / g.replicas
        wall = totals[4 + P : 4 + 2 * P] / g.replicas
        return totals[:4], busy, wall, totals[4 + 2 * P :]

    def evaluate(self) -> dict:
        """Validation through the pipeline (eval mode), each replica on its own block."""
        if self.dataset is None or self.dataset.val_size == 0:
            return {}
        g, b = self.grid, self.cfg.train["batch_size"]
        self.stage.average_buffers()
        lo, hi = val_block(self.dataset.val_size, g.replica, g.replicas)
        n_batches = math.ceil((hi - lo) / b)
        batches = iterate_val(self.dataset, g.replica, g.replicas, b) if g.first else None
        outputs = run_inference(self.stage, self.link, batches, n_batches, b)
        sums = np.zeros(3)
        if g.last:
            val = iterate_val(self.dataset, g.replica, g.replicas, b)
            for (_, y), logits in zip(val, outputs, strict=True):
                logits = logits[: len(y)]
                sums += (
                    cross_entropy_np(logits, y).sum(),
                    int((logits.argmax(-1) == y).sum()),
                    y.size,
                )
        total = self.world.allreduce_array(sums, "sum", "validation metrics")
        return {
            "val_loss": total[0] / total[2],
            "val_accuracy": total[1] / total[2],
            "val_samples": int(total[2]),
        }

    # --- canonical state ------------------------------------------------------------
    def get_weights(self) -> OrderedDict[str, np.ndarray] | None:
        """The whole model under canonical names on rank 0 (None elsewhere).

        Replica 0's stages send their slices to rank 0 (collective over the world). The
        names and layouts are those of a data-parallel run, so the dict loads into
        `Trainer.backend.set_weights` and back into `set_weights` here.
        """
        mine = self.stage.get_weights() if self.grid.replica == 0 else None
        parts = self.world.gather_object(mine, what="gather pipeline weights")
        if not self.world.is_root:
            return None
        merged = {}
        for part in parts:
            merged.update(part or {})
        return OrderedDict((k, merged[k]) for k in self.canonical_names)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Load a full canonical dict (e.g. from a data-parallel run); every rank passes it."""
        missing = [k for k in self.canonical_names if k not in weights]
        if missing:
            raise ValueError(f"weights do not match the model: missing {missing}")
        self.stage.set_weights(weights)


# --- checkpoints --------------------------------------------------------------------
class _StageBackend:
    """The backend surface TrainerCheckpoints uses, for a pipeline: the full canonical
    model is described on every rank, and each rank imports only its stage's part."""

    def __init__(self, trainer: PipelineTrainer):
        self.t = trainer

    def weight_shapes(self) -> dict[str, tuple]:
        return dict(self.t.canonical_shapes)

    def import_state(self, state: dict[str, np.ndarray]) -> None:
        self.t.stage.import_state(state)

    def average_buffers(self) -> None:
        self.t.stage.average_buffers()

    def rng_state(self) -> dict[str, np.ndarray]:
        return self.t.stage.rng_state()

    def set_rng_state(self, state: dict[str, np.ndarray]) -> None:
        self.t.stage.set_rng_state(state)

    def versions(self) -> dict[str, str]:
        import horovod

        name = "torch" if self.t.cfg.backend == "torch" else "tensorflow"
        framework = importlib.import_module(name)
        return {"framework": f"{name} {framework.__version__}", "horovod": horovod.__version__}


class PipelineCheckpoints(TrainerCheckpoints):
    """The data-parallel trainer's policy, files and resume, with the state gathered
    from the stages: replica 0's stages send their tensors and optimizer slots to rank 0,
    which writes them under canonical names (`/model/<name>` exactly as a data-parallel
    run writes them), so checkpoints move between the two strategies both ways."""

    def _collect(self, metrics: dict | None):
        t, w = self.trainer, self.trainer.world
        t.stage.average_buffers()
        rng = {**capture_process_rng(), **t.stage.rng_state()}
        gathered = w.gather_bytes(rng_to_bytes(rng), what="gather random states")
        mine = t.stage.export_state() if t.grid.replica == 0 else None
        parts = w.gather_object(mine, what="gather pipeline state")
        if not w.is_root:
            return None
        merged: dict[str, np.ndarray] = {}
        steps = []
        for part in parts:
            for k, v in (part or {}).items():
                if k == "optimizer/step":
                    steps.append(int(v))
                else:
                    merged[k] = v
        state = {f"model/{k}": merged[f"model/{k}"] for k in t.canonical_names}
        for key in sorted(k for k in merged if k.startswith("optimizer/")):
            state[key] = merged[key]
        if steps:  # every stage steps once per optimizer step: all equal
            state["optimizer/step"] = np.array(max(steps), dtype=np.int64)
        return self.payload(state, gathered, metrics, strategy="pipeline", pipeline_stages=t.stages)
