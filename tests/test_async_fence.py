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
