"""The models `make bench` trains, described once for hpctrain and for the baselines.

Why one table: hpctrain, raw Horovod and the mpi4py loop must train the *same* model on
the same per-rank batch, or their ratio means nothing. Three kinds of step:

- cnn: 3 conv layers on 32x32 images, 24k parameters: compute-bound, tiny gradients;
- resnet: CIFAR ResNet-8, 78k parameters in 29 tensors: more compute, many tensors;
- mlp: 256 -> 1024 -> 1024 -> 10, 1.3M parameters (5 MB of gradients) on vectors:
  little compute per byte, so the allreduce bandwidth shows; 80% of its gradient bytes
  are one matrix, finished only near the end of backward;
- deepmlp: 512 -> 5 x 512 -> 10, the same 5.3 MB of gradients and about the same compute,
  spread over five equal layers, so buckets can travel while backward goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BATCH = 64  # per rank, like Horovod's synthetic benchmark (which uses 32 or 64)


@dataclass(frozen=True)
class Workload:
    name: str
    task: str  # data.task
    model: dict  # the model section (name + options)
    data: dict = field(default_factory=dict)  # data.* besides source/task

    def hpctrain_sets(self) -> list[str]:
        sets = [f"data.task={self.task}", f"model.name={self.model['name']}"]
        for key, value in self.model.items():
            if key != "name":
                sets.append(f"model.{key}={_yaml(value)}")
        for key, value in self.data.items():
            sets.append(f"data.{key}={_yaml(value)}")
        return sets

    def baseline_args(self) -> list[str]:
        args = ["--model", self.model["name"], "--task", self.task]
        for key, value in self.model.items():
            if key != "name":
                args += ["--opt", f"{key}={_yaml(value)}"]
        if "image_size" in self.data:
            args += ["--image-size", str(self.data["image_size"])]
        if "features" in self.data:
            args += ["--features", str(self.data["features"])]
        return args

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.model.items() if k != "name")
        data = ", ".join(f"{k}={v}" for k, v in self.data.items())
        return f"{self.model['name']}({opts}) on {self.task} ({data}), batch {BATCH}/rank"


def _yaml(value) -> str:
    if isinstance(value, list):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


WORKLOADS = {
    "cnn": Workload("cnn", "images", {"name": "cnn"}, {"image_size": 32}),
    "resnet": Workload("resnet", "images", {"name": "resnet", "depth": 8}, {"image_size": 32}),
    "mlp": Workload("mlp", "vectors", {"name": "mlp", "hidden": [1024, 1024]}, {"features": 256}),
    "deepmlp": Workload(
        "deepmlp", "vectors", {"name": "mlp", "hidden": [512] * 5}, {"features": 512}
    ),
}


def gradient_tensors(w: Workload) -> list[int]:
    """Bytes of each float32 gradient tensor, in backward order (last layer first)."""
    import numpy as np

    from hpctrain.data import benchmark_input_spec
    from hpctrain.models import zoo

    data = {"task": w.task, "features": 32, "image_size": 16, "channels": 3, "classes": 10}
    data.update({"seq_len": 32, "vocab": 64}, **w.data)
    layers = zoo.build_layers(w.model, benchmark_input_spec(data))
    sizes = [int(np.prod(s)) * 4 for layer in layers for s in layer.params.values()]
    return sizes[::-1]
