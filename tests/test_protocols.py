"""Every backend, pipeline stage and parameter-server worker class offers each method
its Protocol lists (hpctrain/backends/base.py), with parameters a caller can pass the
same way; the Protocols list what the strategies and the loop call (no mpirun)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from hpctrain.backends.base import Backend, Stage, Worker

IMPLEMENTATIONS = [
    (Backend, "hpctrain.backends.torch", "TorchBackend", "torch"),
    (Backend, "hpctrain.backends.tensorflow", "TensorFlowBackend", "tensorflow"),
    (Stage, "hpctrain.backends.torch_stage", "TorchStage", "torch"),
    (Stage, "hpctrain.backends.tensorflow_stage", "TensorFlowStage", "tensorflow"),
    (Worker, "hpctrain.backends.torch_worker", "TorchWorker", "torch"),
    (Worker, "hpctrain.backends.tensorflow_worker", "TensorFlowWorker", "tensorflow"),
]


def protocol_methods(protocol) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(fn)
        for name, fn in vars(protocol).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


def _unbound(sig: inspect.Signature) -> inspect.Signature:
    """Without `self` (a staticmethod or a function stored on the class has none)."""
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:] if params and params[0].name == "self" else params)


def test_protocols_list_what_callers_use():
    """The methods strategies call on a backend or a stage beyond the basics."""
    assert {"memory_plan", "export_owned_state", "wrap_reducer", "reducer_state"} <= set(
        protocol_methods(Backend)
    )
    assert {"attach_zero", "export_owned", "grad_square_sums", "memory_plan", "tally_step"} <= set(
        protocol_methods(Stage)
    )


@pytest.mark.parametrize(
    "protocol, module, name, framework", IMPLEMENTATIONS, ids=[i[2] for i in IMPLEMENTATIONS]
)
def test_implementation_has_every_protocol_method(protocol, module, name, framework):
    pytest.importorskip(framework)
    cls = getattr(importlib.import_module(module), name)  # lazily: it imports the framework
    missing, mismatched = [], []
    for method, wanted in protocol_methods(protocol).items():
        impl = getattr(cls, method, None)
        if not callable(impl):
            missing.append(method)
            continue
        have = _unbound(inspect.signature(impl))
        # every parameter the Protocol passes is accepted, positionally (extra
        # parameters with defaults are fine)
        try:
            have.bind(*[p.name for p in _unbound(wanted).parameters.values()])
        except TypeError:
            mismatched.append(f"{method}{have} vs {wanted}")
    assert not missing, f"{name} lacks {missing} of {protocol.__name__}"
    assert not mismatched, f"{name}: {mismatched}"
