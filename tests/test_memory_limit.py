"""Where a rank's memory limit comes from and how the pre-flight check reads it: cgroup
v1 and v2 files (the tightest ancestor binds), SLURM's variables, and the refusal and
warning texts. The real limit under mpirun is in test_memory_limit_jobs.py."""

from pathlib import Path

import pytest

from hpctrain.exchange.memory_plan import HOST, TERMS
from hpctrain.runtime.memory import cgroup_memory_limit, current_rss_bytes, slurm_memory_limit
from hpctrain.strategies.memory_check import memory_problem, plan_problem

MIB = 1 << 20


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v1_takes_the_tightest_ancestor(tmp_path):
    base = tmp_path / "memory"
    _write(base / "memory.limit_in_bytes", "9223372036854771712")  # unlimited
    _write(base / "job" / "memory.limit_in_bytes", str(800 * MIB))
    _write(base / "job" / "step" / "memory.limit_in_bytes", str(2000 * MIB))
    _write(base / "job" / "step" / "memory.memsw.limit_in_bytes", "9223372036854771712")
    proc = "12:pids:/job/step\n4:memory:/job/step\n0::/\n"
    limit, where = cgroup_memory_limit(proc, tmp_path)
    assert limit == 800 * MIB
    assert where.endswith("job/memory.limit_in_bytes")


def test_cgroup_v2_reads_memory_max_and_max_means_none(tmp_path):
    _write(tmp_path / "cgroup.controllers", "cpu memory")
    _write(tmp_path / "slurm" / "memory.max", "max")
    _write(tmp_path / "slurm" / "job_7" / "memory.max", str(3 * 1024 * MIB))
    assert cgroup_memory_limit("0::/slurm/job_7\n", tmp_path)[0] == 3 * 1024 * MIB
    assert cgroup_memory_limit("0::/slurm\n", tmp_path) is None
    assert cgroup_memory_limit("0::/elsewhere\n", tmp_path) is None


def test_slurm_grants_per_cpu_times_cpus_or_per_node_divided():
    env = {"SLURM_MEM_PER_CPU": "2000", "SLURM_CPUS_PER_TASK": "4"}
    assert slurm_memory_limit(env, 8)[0] == 8000 * MIB
    assert slurm_memory_limit({"SLURM_MEM_PER_NODE": "64000"}, 16)[0] == 4000 * MIB
    assert slurm_memory_limit({}, 4) is None


def test_current_rss_is_measured():
    assert 10 * MIB < current_rss_bytes() < 64 * 1024 * MIB


PLAN = {"grad": 400 * MIB, "grad_now": 0.0, "optimizer": 800 * MIB, "optimizer_now": 0.0}


@pytest.mark.parametrize(
    "limit_mib, refused, warned",
    [(1000, True, False), (1800, False, True), (4000, False, False)],
)
def test_the_check_adds_what_is_to_come_to_what_is_resident(limit_mib, refused, warned):
    # 500 MiB resident + 400 of gradients + 800 of optimizer state = 1700 MiB
    error, warning = memory_problem(PLAN, 500 * MIB, limit_mib * MIB, "test", "Shard it.")
    assert (error is not None) == refused
    assert (warning is not None) == warned
    if refused:
        assert "about 1,700 MiB per rank" in error
        assert "limit of 1,000 MiB (test)" in error
        assert error.endswith("Shard it.")


def test_state_already_resident_is_not_counted_twice():
    plan = {**PLAN, "optimizer_now": 800 * MIB}
    error, _ = memory_problem(plan, 500 * MIB, 1000 * MIB, "test", "")
    assert error is None


def test_a_tight_zero3_plan_names_the_allocator_setting_that_keeps_its_peak_on_the_plan():
    from hpctrain.runtime import allocator
    from hpctrain.strategies.memory_check import heap_note

    assert "MALLOC_MMAP_THRESHOLD_=4194304" in heap_note(3, keeps_freed=True)
    assert heap_note(2, keeps_freed=True) == ""  # ZeRO-0/1/2 met their plan within 10%
    assert heap_note(3, keeps_freed=False) == ""  # the user's allocator settings
    assert "a pipeline stage's heap" in heap_note(0, keeps_freed=True, pipeline=True)
    applied = allocator.keep_freed_memory()  # glibc on Linux here: the settings apply
    assert allocator.keeps_freed() == (applied == allocator.KEEPING)
    assert allocator.keeps_freed() or "left" in applied or "refused" in applied, applied


def test_the_refusal_suggests_zero3_where_the_backend_can_shard_the_model():
    """Its hints name train.zero=3 for torch and for TensorFlow's zoo models, not for a
    TensorFlow Keras model, which TF's ZeRO-3 refuses."""
    from hpctrain import Config
    from hpctrain.strategies.memory_check import _hint_text

    def hints(*overrides):
        return _hint_text(Config.load(None, list(overrides)))

    assert "train.zero=3" in hints("backend=torch")
    assert "train.zero=3" in hints("backend=tensorflow")
    assert "train.zero=3" not in hints("backend=tensorflow", "model.name=my.module:build")
    moe = ["model.name=transformer", "data.task=tokens", "model.moe.experts=2"]
    assert "train.zero=3" in hints("backend=tensorflow", *moe)


def _terms(offloaded: float = 0.0) -> dict:
    terms = dict.fromkeys(TERMS, 0.0)
    terms.update(parameters=300 * MIB, gradients=300 * MIB, optimizer=400 * MIB)
    terms["total"] = sum(terms[t] for t in TERMS)  # 1,000 MiB
    terms[HOST] = offloaded
    return terms


def test_a_gpu_rank_checks_its_terms_against_the_gpu_and_its_host_share_against_the_host():
    """Before the model exists: every term on the GPU, the baseline and what offload
    keeps on the host against the host's limit; each refusal says where it fails."""
    gpu = (900 * MIB, "900 MiB free for this rank on cuda:0 (NVIDIA H100, 80 GiB)")
    error, _ = plan_problem(_terms(), 500 * MIB, None, "Shard it.", gpu)
    assert error.startswith("the model will not fit on the GPU: training needs about 1,000")
    assert "against 900 MiB free for this rank on cuda:0 (NVIDIA H100" in error
    roomy = (4000 * MIB, "4,000 MiB free")
    assert plan_problem(_terms(), 500 * MIB, None, "", roomy) == (None, None)
    # the host holds the baseline and the offloaded 16 Psi/N, not the GPU's terms
    host = (1000 * MIB, "cgroup")
    assert plan_problem(_terms(400 * MIB), 500 * MIB, host, "", roomy)[0] is None
    error, _ = plan_problem(_terms(600 * MIB), 500 * MIB, host, "", roomy)
    assert "about 1,100 MiB per rank" in error and "offloaded 600 MiB" in error
    # a CPU rank: baseline + every term against the host
    error, _ = plan_problem(_terms(), 500 * MIB, host, "", None)
    assert "about 1,500 MiB per rank" in error and "on the GPU" not in error


def test_a_gpu_refusal_suggests_offload_where_zero_can_take_it():
    from hpctrain import Config
    from hpctrain.strategies.memory_check import _hint_text

    cfg = Config.load(None, ["model.name=transformer", "data.task=tokens"])
    assert "train.offload=optimizer" in _hint_text(cfg, gpu=True)
    assert "train.offload" not in _hint_text(cfg, gpu=False)


def test_a_cpu_rank_has_no_gpu_budget_and_asks_its_node_nothing():
    from hpctrain import Config
    from hpctrain.backends import gpu_memory_budget

    class NoCollectives:
        @property
        def node(self):
            raise AssertionError("runtime.device=cpu needs no collective")

    cfg = Config.load(None, ["runtime.device=cpu"])
    assert gpu_memory_budget(cfg, NoCollectives()) is None
    assert gpu_memory_budget(Config.load(None, ["backend=tensorflow"]), NoCollectives()) is None


def test_ranks_sharing_a_gpu_divide_its_free_memory(monkeypatch):
    """The budget's arithmetic with the CUDA calls stood in for (a GPU run checks the
    real ones: tests/test_gpu.py): two of the node's three ranks on one GPU."""
    import torch

    from hpctrain import Config
    from hpctrain.backends import torch_device
    from hpctrain.runtime.devices import DeviceChoice

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(
        torch_device,
        "resolve_device",
        lambda cfg, layout, node=None: (cuda, DeviceChoice("cuda", 0, "")),
    )
    monkeypatch.setattr(torch_device, "gpu_identity", lambda device: "GPU-a")
    monkeypatch.setattr(torch_device, "describe_gpu", lambda device: "H100, 80 GiB")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 << 30, 80 << 30))

    class Node:
        def allgather_object(self, obj, what=""):
            return ["GPU-a", "GPU-b", obj]

    class World:
        layout, node = None, Node()

    budget, what = torch_device.gpu_memory_budget(Config.load(None, []), World())
    assert budget == 4 << 30
    assert what == "4,096 MiB free for this rank on cuda:0 (H100, 80 GiB, shared by 2 ranks)"


def test_a_rank_whose_cuda_query_fails_still_joins_the_nodes_count(monkeypatch):
    """A CUDA error on one rank must not leave the node's other ranks waiting in the
    allgather: the rank joins it with no GPU and skips the GPU check."""
    import torch

    from hpctrain import Config
    from hpctrain.backends import torch_device
    from hpctrain.runtime.devices import DeviceChoice

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(
        torch_device,
        "resolve_device",
        lambda cfg, layout, node=None: (cuda, DeviceChoice("cuda", 0, "")),
    )

    def broken(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    joined = []

    class Node:
        def allgather_object(self, obj, what=""):
            joined.append(obj)
            return [obj, "GPU-b"]

    class World:
        layout, node = None, Node()

    assert torch_device.gpu_memory_budget(Config.load(None, []), World()) is None
    assert joined == [None]


def test_a_built_model_on_a_gpu_checks_what_it_will_still_allocate_against_the_free_memory():
    from hpctrain.strategies.memory_check import gpu_memory_problem

    gpu = (1000 * MIB, "1,000 MiB free for this rank on cuda:0 (H100, 80 GiB)")
    error, _ = gpu_memory_problem(PLAN, gpu, "Shard it.")  # 400 + 800 MiB to come
    assert error.startswith("the model will not fit on the GPU: training needs about 1,200 MiB")
    assert "against 1,000 MiB free for this rank on cuda:0" in error
    resident = {**PLAN, "optimizer_now": 800 * MIB}  # already allocated: not again
    assert gpu_memory_problem(resident, gpu, "") == (None, None)


def test_a_built_models_check_counts_what_is_held_after_freed_memory_goes_back():
    """check_built's resident figure: the process's RSS once the heap's free memory is
    given back. Subtracting glibc's free bytes instead undercounted after any trim (the
    torch backend trims after its build; warm test ranks after every job): free chunks
    stay counted in mallinfo2 without their pages (measured: 800 MiB freed under live
    arrays, then trimmed: RSS 830 MiB, free bytes 800, so 30 MiB "resident"; in the
    suite a TensorFlow pipeline stage of 880 MiB on a warm rank passed a 100 MiB limit)."""
    import logging

    import numpy as np

    from hpctrain import Config
    from hpctrain.runtime import allocator
    from hpctrain.strategies.memory_check import check_built

    class OneRank:
        node = size = 1

        def agree(self, error):
            self.error = error

    allocator.keep_freed_memory()  # as a rank runs: freed blocks stay in the heap
    freed = [np.ones(1 << 17) for _ in range(300)]  # 300 MiB in the heap, freed below
    held = [np.ones(1 << 17) for _ in range(300)]  # 300 MiB above them, kept
    del freed  # a hole under the heap's top: trimmed pages, its bytes still "free"
    allocator.give_back_freed()  # what the torch backend does once built
    world, nothing = OneRank(), {"grad": 0, "grad_now": 0, "optimizer": 0, "optimizer_now": 0}
    limit = current_rss_bytes() - 100 * MIB  # below what is held, above RSS - free bytes
    cfg = Config.load(None, [f"runtime.memory_limit_mb={limit / MIB}"])
    check_built(cfg, world, lambda: nothing, logging.getLogger("test"))
    assert world.error is not None and "the model will not fit" in world.error, world.error
    del held


def test_where_no_limit_is_known_parameters_beyond_the_node_are_refused():
    """No cgroup, SLURM grant or runtime.memory_limit_mb (a workstation, a bare mpirun):
    a model was built as asked and failed in the allocator with a traceback, or in an
    integer overflow. The bound counts float32 parameters alone, sharded over every rank
    of the job: a model it refuses cannot fit however it is laid out."""
    from hpctrain.strategies.memory_check import beyond_the_node

    gib = 1 << 30
    said = beyond_the_node(10**10, 1, 1, 8 * gib)
    assert said.startswith(
        "the model will not fit: its 10,000,000,000 parameters alone are 37.3 GiB in float32, "
        "all on one rank, and the node has 8.0 GiB"
    )
    said = beyond_the_node(10**10, 2, 4, 8 * gib)  # 4 ranks on 2 nodes: 18.6 GiB each
    assert "even sharded over all 4 ranks of the job, this node's 2 would hold 18.6 GiB" in said
    assert beyond_the_node(10**10, 1, 8, 8 * gib) is None  # 4.7 GiB a node: may fit
    assert beyond_the_node(None, 1, 1, 8 * gib) is None  # a user's model: not known
    assert beyond_the_node(10**10, 1, 1, None) is None  # the system does not say


def test_an_absurd_model_is_one_line_before_it_is_built(tmp_path, capsys):
    from hpctrain.cli import main as cli_main

    argv = ["train", "--run-dir", str(tmp_path / "run"), "--set", "data.train_samples=64"]
    argv += ["--set", "data.val_samples=16", "--set", "model.hidden=[1000000000000000000000]"]
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    text = out.out + out.err
    assert code != 0 and "the model will not fit" in text and "Traceback" not in text, text
