"""Which device a rank computes on, and what is refused before any work (no GPU needed:
the rule is framework-free; the torch side is checked where a GPU is, tests marked gpu)."""

import pytest

from hpctrain.config import Config
from hpctrain.errors import ConfigError
from hpctrain.runtime.devices import choose_device


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
        (["train.allreduce=gloo", "train.zero=1"], "train.allreduce=gloo: the process-group"),
        (["train.allreduce=nccl", "backend=tensorflow"], "not with backend tensorflow"),
        (["runtime.device=cuda", "backend=tensorflow"], "tensorflow backend trains on CPU"),
        (["runtime.device=cuda", "train.zero=2"], "not with train.zero=2"),
    ],
)
def test_refusals_are_one_line_before_any_work(overrides, says):
    with pytest.raises(ConfigError, match=says):
        Config.load("configs/demo.yaml", overrides)


def test_the_process_group_engine_is_accepted_for_dense_data_parallel():
    cfg = Config.load("configs/demo.yaml", ["train.allreduce=gloo", "runtime.device=cpu"])
    assert cfg.train["allreduce"] == "gloo"
