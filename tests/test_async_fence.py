"""An async checkpoint copies the torch backend's live tensors during the next step
(checkpoint.async): the file must hold the state of the step it was taken at, however
late the copy runs, because the backend waits for it before it changes those tensors
(before its update; before the forward when BatchNorm statistics change in forward)."""

import numpy as np
import pytest

from hpctrain import Config
from hpctrain.checkpoint import Checkpointer, CheckpointPolicy, load
from hpctrain.models import zoo
from hpctrain.runtime.faults import Faults

CASES = {
    "mlp": (["model.name=mlp"], zoo.InputSpec((12,), 5)),  # no buffers: fenced at the update
    "resnet": (  # BatchNorm: its running statistics change in the forward
        ["model.name=resnet", "data.task=images", "model.width=4"],
        zoo.InputSpec((3, 8, 8), 4),
    ),
}


@pytest.fixture(scope="module")
def world():
    from hpctrain.runtime import world

    return world()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_late_copy_still_saves_the_step_it_was_taken_at(world, tmp_path, name):
    from hpctrain.backends.torch import TorchBackend

    overrides, inp = CASES[name]
    cfg = Config.load(None, [*overrides, "optimizer.name=adam", "optimizer.lr=0.01"])
    backend = TorchBackend(cfg, world, inp, 1)
    rng = np.random.default_rng(0)

    def batch():
        x = rng.standard_normal((8, *inp.shape)).astype(np.float32)
        return [(x, rng.integers(0, inp.classes, 8))]

    backend.train_step(batch(), 0.01)  # Adam's slots exist
    late = Faults(copy_delay=(0, 0.3))  # the deferred copy starts 0.3 s late
    ck = Checkpointer(CheckpointPolicy({"dir": str(tmp_path), "async": True}), faults=late)
    state = backend.export_state()
    expected = {k: np.array(v, copy=True) for k, v in state.items()}
    assert backend.hold_exported_state(ck.fence)
    ck.save(1, state, {"step": 1}, private=True, defer_copy=True)
    backend.train_step(batch(), 0.01)  # changes every tensor it exported
    path = ck.wait()
    after = backend.export_state()
    assert any(not np.array_equal(after[k], expected[k]) for k in expected)
    if name == "resnet":  # the forward itself moved the running statistics
        assert any("running_mean" in k and not np.array_equal(after[k], expected[k]) for k in after)
    saved = load(path).state
    assert sorted(saved) == sorted(expected)
    for k in expected:
        np.testing.assert_array_equal(saved[k], expected[k], err_msg=k)


@pytest.mark.parametrize("mode", ["deferred", "async", "sync"])
def test_arrays_still_filling_are_read_only_after_ready(tmp_path, mode):
    """A GPU rank's staged export hands the save arrays its copy is still filling
    (torch_mirror.py): the save calls `ready` on the thread that reads them, before it
    reads; with a deferred copy that is the background thread, after save returned
    (here `ready` fills the array, as the end of the GPU's copy would)."""
    import threading

    buffer = np.zeros(1000, np.float32)  # the pinned buffer the GPU's copy fills
    returned, calls = threading.Event(), []

    def ready():
        calls.append(threading.current_thread().name)
        if mode == "deferred":
            assert returned.wait(30), "the save waited for the copy before it returned"
        buffer[:] = 7.0

    policy = CheckpointPolicy({"dir": str(tmp_path), "async": mode != "sync"})
    ck = Checkpointer(policy)
    deferred = mode == "deferred"
    ck.save(3, {"model/w": buffer[:]}, {"step": 3}, private=True, defer_copy=deferred, ready=ready)
    returned.set()
    path = ck.wait()
    reader = "hpctrain-checkpoint" if deferred else threading.current_thread().name
    assert calls == [reader]
    np.testing.assert_array_equal(load(path).state["model/w"], np.full(1000, 7.0, np.float32))


def test_a_host_mirror_keeps_an_exports_values_in_reused_buffers():
    """torch_mirror.HostMirror on a CPU device (on a GPU, tests/test_gpu.py): each
    export's arrays hold the tensors' values at the export, the next export reuses the
    buffers that still fit, and they are views (an async save copies them)."""
    import torch

    from hpctrain.backends.torch_mirror import HostMirror

    mirror = HostMirror(torch.device("cpu"))
    weight, count = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.int64)
    with mirror.copying() as (take, scalar):
        first = [take(weight), take(count)]
        adam_step = scalar(torch.tensor(3.0), np.int64)  # on the host: read at once
    weight += 10.0  # the next update
    np.testing.assert_array_equal(first[0], np.arange(6.0).reshape(2, 3))
    assert first[1].dtype == np.int64 and not first[0].flags.owndata
    assert adam_step.dtype == np.int64 and adam_step.shape == () and int(adam_step) == 3
    with mirror.copying() as (take, _):
        second = [take(weight), take(torch.zeros(5))]
    assert np.shares_memory(first[0], second[0])  # the same shape: the same buffer
    assert not np.shares_memory(first[1], second[1])
    np.testing.assert_array_equal(second[0], weight.numpy())
    mirror.ready()  # nothing queued on a CPU device
    mirror.release()
    assert not mirror.pending


@pytest.mark.parametrize("residuals", [False, True], ids=["dense", "error-feedback"])
def test_an_async_save_stages_the_export_unless_it_will_be_written_at_once(tmp_path, residuals):
    """With per-rank error-feedback state the save is written on the training thread
    (its files commit with the rank's), so rank 0 does not stage its export into the
    GPU's pinned buffers only to wait for them there: it asks for host copies at once."""
    from types import SimpleNamespace

    from hpctrain.checkpoint.session import RunCheckpoints

    asked = []
    strategy = SimpleNamespace(
        average_buffers=lambda: None,
        rng_state=lambda: {},
        rank_state=lambda: {"reducer/residual": np.zeros(3)} if residuals else {},
        export_state=lambda staged=False: asked.append(staged) or {"model/w": np.zeros(2)},
        wait_exported=lambda: None,
        hold_exported_state=lambda fence: True,
    )
    world = SimpleNamespace(
        is_root=True, size=1, gather_bytes=lambda data, what: [data], barrier=lambda *a: None
    )
    run = RunCheckpoints.__new__(RunCheckpoints)
    run.trainer = SimpleNamespace(world=world, strategy=strategy)
    run.policy = CheckpointPolicy({"dir": str(tmp_path), "async": True})
    run.checkpointer = SimpleNamespace(fence=lambda: None, wait_written=lambda: None)
    run._write_rank_state = lambda arrays: [{"rank": 0}]
    run.payload = lambda state, gathered, metrics: {"state": state}
    payload = run._collect(None)
    assert asked == [not residuals]
    assert ("shards" in payload) == residuals  # what makes manager.py write it at once
