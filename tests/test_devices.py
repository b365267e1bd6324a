"""Which device a rank computes on, and what is refused before any work (no GPU needed:
the rule is framework-free; the torch side is checked where a GPU is, tests marked gpu)."""

import pytest

from hpctrain.config import Config
from hpctrain.errors import ConfigError
from hpctrain.runtime.devices import assign_gpus, choose_device


def _choose(wanted, gpus, local_rank=0, local_size=1, engine="auto", supported=None):
    return choose_device(wanted, gpus, local_rank, local_size, "hpcn1", engine, supported)


def test_auto_stays_on_the_cpu_without_a_gpu_and_cuda_is_refused_naming_the_node():
    assert _choose("auto", 0).kind == "cpu"
    assert _choose("cpu", 4).kind == "cpu"
    with pytest.raises(ConfigError, match="runtime.device=cuda: no usable CUDA GPU on hpcn1"):
        _choose("cuda", 0)


def test_one_gpu_per_rank_by_node_local_rank():
    picks = [_choose("auto", 4, r, 4, engine="nccl").index for r in range(4)]
    assert picks == [0, 1, 2, 3]
    # a rank that sees exactly one GPU (--gpu-bind, CUDA_VISIBLE_DEVICES) uses it
    assert _choose("cuda", 1, local_rank=3, local_size=4, engine="nccl").index == 0


def test_ranks_that_see_their_sockets_gpus_take_one_each():
    """SLURM's --gpu-bind=closest on a node of 4 GPUs, 2 a socket, tasks placed
    cyclically: ranks 0 and 2 see GPUs a, b; ranks 1 and 3 see c, d. By local rank
    alone ranks 0 and 2 both took a (and nccl was refused: "4 ranks but 2 GPUs"); now
    the node's ranks share what each sees and take one each."""
    seen = [["a", "b"], ["c", "d"], ["a", "b"], ["c", "d"]]
    assert assign_gpus(seen) == [0, 1, 1, 0]
    picks = [
        choose_device("cuda", 2, r, 4, "hpcn1", "nccl", None, node_gpus=seen) for r in range(4)
    ]
    assert [seen[r][c.index] for r, c in enumerate(picks)] == ["a", "d", "b", "c"]
    # every rank seeing every GPU lands where the local rank put it
    assert assign_gpus([["a", "b", "c", "d"]] * 4) == [0, 1, 2, 3]
    # more ranks than the node's GPUs: refused under nccl, the least used shared otherwise
    with pytest.raises(ConfigError, match="node hpcn1 runs 3 ranks but has 2 GPUs"):
        choose_device("cuda", 2, 0, 3, "hpcn1", "nccl", None, node_gpus=[["a", "b"]] * 3)
    assert assign_gpus([["a", "b"]] * 3) == [0, 1, 0]
    assert assign_gpus([["a"], [], ["a", "b"]]) == [0, None, 1]


def test_more_ranks_than_gpus_is_refused_unless_staged_through_the_host():
    with pytest.raises(ConfigError, match="node hpcn1 runs 8 ranks but has 4 GPUs"):
        _choose("cuda", 4, local_rank=5, local_size=8, engine="nccl")
    assert _choose("cuda", 4, local_rank=5, local_size=8, engine="mpi").index == 1


def test_a_layout_gpus_cannot_run_yet_keeps_auto_on_the_cpu_and_refuses_cuda():
    why = "strategy pipeline runs on CPU ranks only so far"
    assert _choose("auto", 2, supported=why).kind == "cpu"
    with pytest.raises(ConfigError, match=why):
        _choose("cuda", 2, supported=why)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["train.allreduce=nccl", "runtime.device=cpu"], "NCCL needs GPU ranks"),
        (["train.allreduce=gloo", "train.sync_every=4"], "train.allreduce=gloo: the process-group"),
        (["train.allreduce=nccl", "backend=tensorflow"], "not with backend tensorflow"),
        (["runtime.device=cuda", "backend=tensorflow"], "tensorflow backend trains on CPU"),
        (["runtime.device=cuda", "train.allreduce=mpi", "train.zero=2"], "nccl \\(or auto\\)"),
        (["runtime.device=cuda", "train.hierarchical=true"], "do not run train.hierarchical"),
        (["runtime.device=cuda", "train.allreduce=horovod"], "not with train.allreduce=horovod"),
    ],
)
def test_refusals_are_one_line_before_any_work(overrides, says):
    with pytest.raises(ConfigError, match=says):
        Config.load("configs/demo.yaml", overrides)


def test_nccl_where_auto_keeps_the_ranks_on_the_cpu_says_why(monkeypatch):
    """auto on a node without a usable GPU (or a layout gated on GPUs) kept the ranks on
    the CPU, and the engine then said only 'NCCL needs GPU ranks'."""
    import torch

    from hpctrain.backends.torch_device import agreed_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    cfg = Config.load("configs/demo.yaml", ["train.allreduce=nccl"])
    with pytest.raises(
        ConfigError, match=r"nccl needs GPU ranks, and these are CPU ranks \(auto: "
    ):
        agreed_device(cfg, None)


def test_offload_under_auto_is_accepted_by_the_config_and_refused_on_cpu_ranks(monkeypatch):
    """runtime.device=auto (the default) cannot know at config time whether the ranks
    get a GPU: offload was refused there as if they were CPU ranks, even on GPU nodes."""
    import torch

    from hpctrain.backends.torch_device import agreed_device

    offload = ["train.zero=2", "train.allreduce=gloo", "train.offload=optimizer"]
    cfg = Config.load("configs/demo.yaml", offload)
    assert cfg.runtime["device"] == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(
        ConfigError, match=r"train.offload=optimizer: .* these are CPU ranks \(auto: "
    ):
        agreed_device(cfg, None)


@pytest.mark.parametrize("engine", ["auto", "nccl", "gloo"])
def test_gpu_ranks_run_zero_tensor_parallelism_experts_and_compression_on_process_groups(
    engine, monkeypatch
):
    on = ["runtime.device=cuda", f"train.allreduce={engine}"]
    with pytest.raises(ConfigError, match="not yet run across ranks on a GPU"):
        Config.load("configs/transformer-tp-zero.yaml", on)
    monkeypatch.setenv("HPCTRAIN_GPU_UNTESTED", "1")  # as the GPU check runs them
    zero3 = Config.load("configs/transformer-tp-zero.yaml", [*on, "train.zero=3"])
    assert zero3.train["zero"] == 3 and zero3.parallel["tensor"] == 2
    assert Config.load("configs/demo.yaml", [*on, "train.compression=powersgd"])
    assert Config.load("configs/moe.yaml", on).model["moe"]
    moe_tp = Config.load("configs/moe.yaml", [*on, "parallel.tensor=2"])
    assert moe_tp.parallel["tensor"] == 2 and moe_tp.model["moe"]
    moe_pipe = ["strategy=pipeline", "parallel.expert=null"]  # experts in the stages
    assert Config.load("configs/pipeline.yaml", on).strategy == "pipeline"
    assert Config.load("configs/moe.yaml", [*on, *moe_pipe]).model["moe"]
    with pytest.raises(ConfigError, match="strategy parameter_server runs on CPU ranks only"):
        Config.load("configs/ps.yaml", on)


@pytest.mark.parametrize(
    "overrides, says",
    [
        ([], "strategy pipeline on GPU ranks: not yet run across ranks on a GPU"),
        (["train.allreduce=mpi"], "train.allreduce=mpi exchanges host arrays"),
        (["train.allreduce=horovod"], "train.allreduce=horovod exchanges host arrays"),
        (["train.zero=1"], "strategy pipeline, train.zero=1 on GPU ranks: not yet run"),
        (["train.compression=fp16"], "train.compression=fp16 exchanges host arrays"),
        (["train.allreduce=nccl"], "strategy pipeline on GPU ranks: not yet run across"),
    ],
)
def test_the_pipeline_runs_dense_stages_on_gpu_ranks_over_a_process_group(overrides, says):
    """A GPU stage computes on its device and sends over the pipe axis's process groups
    (NCCL's, or Gloo's through the host); what exchanges host arrays is refused in one
    line, and the layout waits for the GPU check's verdict like every untested one."""
    with pytest.raises(ConfigError, match=says):
        Config.load("configs/pipeline.yaml", ["runtime.device=cuda", *overrides])


def test_the_process_group_engine_is_accepted_for_dense_data_parallel():
    cfg = Config.load("configs/demo.yaml", ["train.allreduce=gloo", "runtime.device=cpu"])
    assert cfg.train["allreduce"] == "gloo"


@pytest.mark.parametrize("method", ["fp16", "bf16", "topk", "randomk", "int8", "powersgd"])
def test_the_process_group_engine_compresses_but_leaves_hierarchy_to_mpi(method):
    cfg = Config.load("configs/demo.yaml", ["train.allreduce=gloo", f"train.compression={method}"])
    assert cfg.train["compression"] == method
    with pytest.raises(ConfigError, match="gloo: .* not with train.hierarchical"):
        Config.load("configs/demo.yaml", ["train.allreduce=gloo", "train.hierarchical=true"])


def test_the_process_group_engine_runs_tensor_parallelism_zero3_and_experts_everywhere():
    tp = Config.load("configs/transformer-tp-zero.yaml", ["train.allreduce=gloo"])
    assert tp.parallel["tensor"] == 2 and tp.train["zero"] == 1
    assert Config.load("configs/moe.yaml", ["train.allreduce=gloo"]).train["allreduce"] == "gloo"
    for experts_with in (["parallel.tensor=2"], ["strategy=pipeline", "parallel.expert=null"]):
        cfg = Config.load("configs/moe.yaml", ["train.allreduce=gloo", *experts_with])
        assert cfg.model["moe"] and cfg.train["allreduce"] == "gloo"
    with pytest.raises(ConfigError, match="blocks inside pipeline stages run without ZeRO"):
        Config.load(
            "configs/moe.yaml",
            ["train.allreduce=gloo", "strategy=pipeline", "parallel.expert=null", "train.zero=1"],
        )
    zero3 = Config.load(
        "configs/transformer-tp-zero.yaml", ["train.allreduce=gloo", "train.zero=3"]
    )
    assert zero3.train["zero"] == 3 and zero3.parallel["tensor"] == 2


def test_a_device_steps_sums_are_read_one_push_later_and_drain_reads_them_all():
    """GPU ranks leave a step's sums on the device; the step report reads them at the
    next push (after the next step is queued). 0-d tensors stand in for device sums."""
    import torch

    from hpctrain.backends.base import StepStats
    from hpctrain.step_reports import StepReducer

    def push_all(reducer, make):
        out = []
        for k in range(1, 5):
            out += [r.step for r in reducer.push(k, make(k), 0.1, 0.01)]
        return out, [r.step for r in reducer.drain()]

    host = push_all(StepReducer(None), lambda k: StepStats(float(k), 1, 4, 0.0))
    device = push_all(
        StepReducer(None, deferred=True),
        lambda k: StepStats(torch.tensor(float(k), dtype=torch.float64), 1, 4, 0.0),
    )
    assert host == ([1, 2, 3], [4])
    assert device == ([1, 2], [3, 4])  # one push later; nothing lost at the drain
    r = StepReducer(None, deferred=True)
    r.push(1, StepStats(torch.tensor(float("nan")), 0, 4, 0.0), 0.1, 0.01)
    (report,) = r.drain()
    assert report.nonfinite and report.step == 1  # NaN on the device still stops the run


class _ThreadWorld:
    """Two ranks as threads: a sum over the pair matched by call order, as MPI's
    collectives are, and a per-step gradient collective; every wait has a deadline."""

    size = 2

    def __init__(self, deadline):
        import threading

        self.deadline = deadline
        self.lock = threading.Lock()
        self.sums: dict = {}  # call index -> {rank: array}
        self.calls = [0, 0]
        self.gradients = threading.Barrier(2, timeout=deadline)

    def rank(self, r):
        world = self

        class Rank:
            size = 2

            def start_allreduce_array(self, local, op, what):
                with world.lock:
                    n = world.calls[r]
                    world.calls[r] += 1
                    world.sums.setdefault(n, {})[r] = local
                return world.pending(n)

        return Rank()

    def pending(self, n):
        import time

        world = self

        class Pending:
            def wait(self):
                end = time.monotonic() + world.deadline
                while len(world.sums[n]) < 2:
                    assert time.monotonic() < end, f"step-metrics sum {n} never completed"
                    time.sleep(0.001)
                return world.sums[n][0] + world.sums[n][1]

        return Pending()


def _run_two_gpu_ranks(deferred_by_rank, deadline):
    """The loop's rule on two GPU ranks (loop.py `_train`): push each step, drain when an
    agreed flag says save, take the next step's gradient collective. Rank 0 holds the
    loss as a device tensor, rank 1 a float 0.0 (a pipeline stage but the last); rank 1
    alone wishes to save after step 3 (a time-based checkpoint). Returns, per rank, the
    steps where it saved; raises if the ranks deadlock."""
    import threading

    import torch

    from hpctrain.backends.base import StepStats
    from hpctrain.step_reports import StepReducer

    world, saved, errors = _ThreadWorld(deadline), [[], []], []

    def rank(r):
        reducer = StepReducer(world.rank(r), deferred=deferred_by_rank[r])
        try:
            for step in range(1, 9):
                world.gradients.wait()  # the step's own collective
                loss = torch.tensor(1.0, dtype=torch.float64) if r == 0 else 0.0
                stats = StepStats(loss, 0, 4 if r == 0 else 0, 0.0)
                reports = reducer.push(step, stats, 0.1, 0.01, save_due=(r == 1 and step == 3))
                if any(rep.save_due for rep in reports):
                    reducer.drain()  # a checkpoint must see this step's result
                    saved[r].append(step)
            reducer.drain()
        except Exception as exc:  # a broken barrier or a sum that never completes
            errors.append(f"rank {r}: {type(exc).__name__} {exc}")
            world.gradients.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline * 4)
    return saved, errors


def test_gpu_ranks_without_the_loss_defer_their_step_reports_as_the_loss_owner_does():
    """Every rank of a GPU job defers its step reports, whether or not its sums are
    tensors: decided per rank, the rank without the loss settles each step one push
    earlier, drains for a flag at an earlier step than the loss's owner, and both wait
    on each other (a deadlock, shown here first)."""
    _, errors = _run_two_gpu_ranks([True, False], 2)  # the per-rank rule it replaced
    assert errors, "the mixed decision was expected to deadlock"
    saved, errors = _run_two_gpu_ranks([True, True], 60)  # one rule for the job
    assert not errors
    assert saved[0] == saved[1] == [5]  # step 3's flag settles two pushes later, on both


def test_a_device_steps_read_is_a_watchdog_section():
    """On NCCL the host waits only where it reads a step's sums: that read is a section
    of the MPI watchdog's, so a peer that stopped is named at the collective timeout,
    before NCCL's own (a host step's numbers are plain floats: no section)."""
    import contextlib

    import torch

    from hpctrain.backends.base import StepStats
    from hpctrain.runtime.comm import PendingArray
    from hpctrain.step_reports import StepReducer

    class Sum:  # a device sum: reading it is the wait
        def __init__(self, value, log):
            self.value, self.log = value, log

        def __float__(self):
            self.log.append("read")
            return self.value

    class World:
        size = 1

        def __init__(self):
            self.log = []
            self.watchdog = self

        @contextlib.contextmanager
        def guard(self, what):
            self.log.append(f"enter {what}")
            yield
            self.log.append("leave")

        def start_allreduce_array(self, local, op, what):
            return PendingArray(local)

    w = World()
    r = StepReducer(w)
    r.push(1, StepStats(Sum(2.0, w.log), torch.tensor(3.0), 4, 0.0), 0.1, 0.01)
    (report,) = r.drain()
    assert w.log == ["enter step 1's device work", "read", "leave"]
    assert (report.loss_sum, report.totals[1]) == (2.0, 3.0)
    r.push(2, StepStats(5.0, 1, 4, 0.0), 0.1, 0.01)
    r.drain()
    assert len(w.log) == 3  # a host step's floats: no section


def test_the_pipeline_runs_on_the_process_group_engine_with_its_zero():
    cfg = Config.load("configs/pipeline.yaml", ["train.allreduce=gloo"])
    assert cfg.strategy == "pipeline"
    zero = Config.load("configs/pipeline.yaml", ["train.allreduce=gloo", "train.zero=1"])
    assert zero.train["zero"] == 1
    with pytest.raises(ConfigError, match="pipeline shards with ZeRO-1"):
        Config.load("configs/pipeline.yaml", ["train.allreduce=gloo", "train.zero=2"])
    with pytest.raises(ConfigError, match="not with backend tensorflow"):
        Config.load("configs/pipeline.yaml", ["train.allreduce=gloo", "backend=tensorflow"])


def test_a_gpu_rank_started_past_the_untested_gate_says_so(monkeypatch):
    """HPCTRAIN_GPU_UNTESTED=1 starts ZeRO on a GPU rank, and the device's reason (the
    startup line) names what has not run across ranks on a GPU yet."""
    import torch

    from hpctrain.backends import torch_device

    monkeypatch.setenv("HPCTRAIN_GPU_UNTESTED", "1")
    monkeypatch.setattr(torch_device, "visible_gpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    cfg = Config.load("configs/demo.yaml", ["runtime.device=cuda", "train.zero=2"])
    device, choice = torch_device.resolve_device(cfg, None)
    assert device.type == "cuda"
    assert "train.zero=2 not yet run across ranks on a GPU (HPCTRAIN_GPU_UNTESTED=1)" in (
        choice.reason
    )
    plain = Config.load("configs/demo.yaml", ["runtime.device=cuda"])
    assert "not yet run" not in torch_device.resolve_device(plain, None)[1].reason


def test_every_run_of_the_gpu_check_is_a_configuration_gpu_ranks_accept(monkeypatch):
    """tests/test_gpu_jobs.py's runs (references, layouts, compressors) load as GPU ranks
    load them, here without a GPU: a refusal would otherwise first show on the loaned GPU
    machine, failing the whole module there (its experts' reference once asked for the
    MPI engine, which GPU ranks refuse experts on)."""
    import test_gpu_jobs

    monkeypatch.setenv("HPCTRAIN_GPU_UNTESTED", "1")  # as the GPU check runs them
    runs = test_gpu_jobs.every_run()
    assert len(runs) == len(test_gpu_jobs.REFS) + len(test_gpu_jobs.LAYOUTS) + 2 * len(
        test_gpu_jobs.LOSSY
    )
    for name, overrides in runs.items():
        cfg = Config.load(None, [*test_gpu_jobs.BASE, *overrides])  # raises if refused
        wanted = "cpu" if "runtime.device=cpu" in overrides else "cuda"
        assert cfg.runtime["device"] == wanted, name


class _OneRank:
    is_root, rank, size = True, 0, 1

    def bcast_object(self, obj, what=""):
        return obj


def test_nccl_groups_bind_no_device_so_each_subgroup_needs_only_its_members(monkeypatch):
    """With a device bound to the default group, torch makes every later subgroup by
    splitting its NCCL communicator, a collective every rank of the job must enter;
    grid_groups' subgroups are made by their members alone (use_local_synchronization),
    so the members would wait out NCCL's timeout. The default group binds none."""
    import inspect

    import torch.distributed as dist

    from hpctrain.backends.torch_pg import init_process_group

    helper = inspect.getsource(dist.distributed_c10d._new_process_group_helper)
    assert "_get_default_group().bound_device_id" in helper  # torch's rule for splitting
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw))
    init_process_group(_OneRank(), "nccl", 5.0)
    assert seen["world_size"] == 1 and "device_id" not in seen, seen


def _fused_sgd_run(make, scaled: bool, overflow_first: bool, steps: int):
    """Parameters after `steps` SGD steps (momentum 0.9) of a small linear layer under
    deterministic mode (fresh memory filled with NaN), the first step's loss made
    infinite when `overflow_first` (fp16's loss scaler then skips that step)."""
    import torch

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    opt = make(list(lin.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if scaled else None
    x = torch.randn(8, 4)
    for step in range(steps):
        opt.zero_grad()
        loss = lin(x).square().sum()
        if overflow_first and step == 0:
            loss = loss * float("inf")
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return [p.detach().clone() for p in lin.parameters()]


def test_fused_sgd_survives_an_fp16_overflow_on_its_first_step():
    """torch's fused SGD (hpctrain's on GPUs) makes its momentum with empty_like at the
    first step and fills it in the kernel, which the loss scaler skips on an overflow:
    the momentum was then uninitialised memory (NaN under train.deterministic). Run on
    the CPU, where torch has the same fused kernel and scaler."""
    import torch

    from hpctrain.backends.torch_steps import make_sgd

    ocfg = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        plain = _fused_sgd_run(
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), True, True, 3
        )
        mine = _fused_sgd_run(lambda ps: make_sgd(ocfg, ps, fused=True), True, True, 3)
        skipped = _fused_sgd_run(lambda ps: make_sgd(ocfg, ps, fused=True), False, False, 2)
        torch_first = _fused_sgd_run(
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), False, False, 2
        )
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    assert all(torch.isnan(p).all() for p in plain)  # torch's own: NaN from step 2 on
    # the overflowed step skipped, the two others exactly as two steps without a scaler
    # (its scale is a power of two: unscaling is exact)
    assert all(torch.equal(a, b) for a, b in zip(mine, skipped))
    # and zeros to start from change nothing where no step is skipped
    assert all(torch.equal(a, b) for a, b in zip(skipped, torch_first))


def test_a_gpu_ranks_exported_arrays_own_their_memory_so_a_checkpoint_copies_them_once():
    """to_host's GPU path copies into numpy-owned memory: the async checkpoint's
    background copy skips arrays that own their memory (checkpoint/writer.py), which a
    `.cpu().numpy()` result never does. Run here on CPU tensors, the same copy."""
    import numpy as np
    import torch

    from hpctrain.backends.torch_device import owned_copy
    from hpctrain.checkpoint.staging import Staging
    from hpctrain.checkpoint.writer import _private_copies

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    counts = torch.tensor([1, 2], dtype=torch.int64)
    mine = [owned_copy(t), owned_copy(counts), owned_copy(torch.tensor(7.0))]
    assert all(a.flags.owndata for a in mine)
    np.testing.assert_array_equal(mine[0], t.numpy())
    assert mine[1].dtype == np.int64 and mine[2].shape == () and float(mine[2]) == 7.0
    datasets = [("a", mine[0], {}), ("b", t.cpu().numpy(), {})]
    out = _private_copies(datasets, Staging(), private=True)
    assert out[0][1] is mine[0]  # kept as it is: no second copy
    assert out[1][1] is not datasets[1][1]  # .cpu().numpy(): copied again


def test_experts_without_gradients_still_sum_on_the_process_group():
    """The experts' square sum is a 0-d tensor even when no local expert has a gradient:
    a Python 0.0 takes the expert group's MPI path (moe/parallel.py `allreduce_sum`)
    while peers with gradients sum over its process group, and both wait forever."""
    import torch

    from hpctrain.backends.torch import TorchBackend

    bare = [torch.nn.Parameter(torch.zeros(3))]
    got = TorchBackend.expert_square_sum(None, bare)
    assert torch.is_tensor(got) and got.dtype == torch.float64 and float(got) == 0.0
    bare[0].grad = torch.full((3,), 2.0)
    assert float(TorchBackend.expert_square_sum(None, bare)) == 12.0


def test_nccl_error_handling_is_pinned_unless_set_and_the_exit_has_a_deadline(
    monkeypatch, caplog, capsys
):
    """NCCL's fallback after its timeout stays on (torch's default, set unless the site
    set it; its 0 is warned about), and destroying the groups at exit cannot hang."""
    import time

    from hpctrain.backends import torch_pg

    name = torch_pg.NCCL_ERROR_HANDLING[0]
    monkeypatch.delenv(name, raising=False)
    torch_pg._nccl_error_handling(True)
    assert __import__("os").environ[name] == "3"
    monkeypatch.setenv(name, "0")
    with caplog.at_level("WARNING", logger="hpctrain"):
        torch_pg._nccl_error_handling(True)
    assert f"{name}=0: a hung NCCL collective" in caplog.text
    monkeypatch.setattr(torch_pg, "EXIT_DEADLINE_S", 0.2)
    monkeypatch.setattr(torch_pg.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_pg.dist, "destroy_process_group", lambda: time.sleep(5))
    torch_pg._exit_worker()  # started with the first group

    def no_threads_at_exit(self):  # Python 3.12's interpreter shutdown
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(torch_pg.threading.Thread, "start", no_threads_at_exit)
    t0 = time.monotonic()
    torch_pg._destroy_at_exit()
    assert time.monotonic() - t0 < 2
    assert "exiting without them" in capsys.readouterr().err


def test_a_failed_process_group_wait_is_one_line_naming_the_wait(capsys):
    """A pipeline over Gloo whose peer stopped ended with rank 0's 30-line 'uncaught
    exception' traceback around the wait's name; on the MPI engine it is one line."""
    import torch

    from hpctrain.backends.torch_transport import ProcessGroupTransport
    from hpctrain.runtime import run_fail_together

    transport = ProcessGroupTransport(None, "gloo", 10, torch.device("cpu"))

    class TimedOut:
        def wait(self, timeout=None):
            raise RuntimeError("[gloo] Timed out waiting 10000ms for recv operation")

    what = "pipeline stage 0 (rank 0) waiting for the gradient (from stage 1 (rank 1))"
    code = run_fail_together(lambda: transport.wait_work(TimedOut(), what, p2p=True))
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err, err
    assert f"error: gloo '{what}' failed on rank 0 of 1 (deadline 10 s" in err, err
