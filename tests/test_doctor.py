"""`hpctrain doctor`'s verdict names the nodes that lack a piece (the whole doctor runs
under mpirun in test_runtime_jobs.py and on two emulated hosts in test_multinode.py)."""

from __future__ import annotations

from hpctrain.doctor import missing_by_host


def _layouts(*hosts: str) -> list[dict]:
    return [{"rank": r, "hostname": h} for r, h in enumerate(hosts)]


def test_a_piece_missing_on_one_node_names_that_node():
    layouts = _layouts("n1", "n1", "n2", "n2")
    failures = [[], [], ["torch: horovod without MPI"], []]
    assert missing_by_host(layouts, failures) == ["torch: horovod without MPI (on n2)"]


def test_a_piece_missing_everywhere_says_every_node_once():
    layouts = _layouts("n1", "n1", "n2", "n2")
    failures = [["h5py"], ["h5py"], ["h5py", "tensorflow"], ["h5py"]]
    assert missing_by_host(layouts, failures) == [
        "h5py (on every node)",
        "tensorflow (on n2)",
    ]


def test_many_nodes_are_cut_after_eight():
    hosts = [f"node{i:03d}" for i in range(20)]
    failures = [["mpi4py"] if i % 2 else [] for i in range(20)]
    (line,) = missing_by_host(_layouts(*hosts), failures)
    assert line == "mpi4py (on " + ", ".join(hosts[1:17:2]) + " and 2 more)"


def test_one_host_or_no_mpi_keeps_the_plain_list():
    assert missing_by_host(_layouts("n1", "n1"), [["h5py"], []]) == ["h5py (on n1)"]
    assert missing_by_host(None, [["tensorflow", "h5py"]]) == ["h5py", "tensorflow"]


def _layout(local_rank: int, local_size: int):
    from types import SimpleNamespace

    return SimpleNamespace(local_rank=local_rank, local_size=local_size)


def test_each_node_probes_each_framework_once_over_its_first_two_ranks():
    from hpctrain.doctor import _backends_to_probe

    assert _backends_to_probe(None) == ("torch", "tensorflow")  # no MPI: one process
    assert _backends_to_probe(_layout(0, 1)) == ("torch", "tensorflow")  # a node of one
    probed = [_backends_to_probe(_layout(r, 4)) for r in range(4)]
    assert probed == [("torch",), ("tensorflow",), (), ()]


def test_rank_zeros_node_rows_come_from_the_ranks_that_probed_them():
    from hpctrain.doctor import _node_framework_rows

    torch_rows = [("torch", "2"), ("horovod[torch]", "h")]
    tf_rows = [("tensorflow", "2"), ("horovod[tensorflow]", "h")]
    layouts = [
        {"hostname": "n1", "framework_rows": {"torch": torch_rows}},
        {"hostname": "n2", "framework_rows": {"torch": [("torch", "other node")]}},
        {"hostname": "n1", "framework_rows": {"tensorflow": tf_rows}},
        {"hostname": "n2", "framework_rows": {"tensorflow": [("tensorflow", "other")]}},
    ]
    assert _node_framework_rows(layouts, {"torch": torch_rows}) == torch_rows + tf_rows


def test_a_node_without_gpu_devices_answers_without_importing_torch(monkeypatch):
    import sys

    from hpctrain import doctor

    monkeypatch.setattr(doctor, "GPU_DEVICE_FILES", ("/nonexistent/nvidia0",))
    monkeypatch.setitem(sys.modules, "hpctrain.backends.torch", None)  # an import fails
    monkeypatch.setitem(sys.modules, "hpctrain.backends.torch_device", None)
    seen = [doctor._visible_gpu_ids(), ["GPU-a"]]
    assert seen[0] == [] and doctor._gpu_of_rank(seen, 0) == "-"
    # a rank that sees a GPU names it through the backend (here: its import fails)
    assert doctor._gpu_of_rank(seen, 1) == "- (ModuleNotFoundError)"
