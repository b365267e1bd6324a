"""tp_train_dump.py with `train.offload` let through on CPU ranks, for the tests only.

hpctrain refuses offload on CPU ranks: their state is in host memory already, so there
is nothing to gain. The code is a GPU rank's but for the pinning and the device copies
(the host shard, the CPU's update, the staged gathers), so the suite runs it across
ranks over Gloo here; tests/test_gpu_jobs.py runs it on a GPU.
"""

import runpy
import sys
from pathlib import Path

from hpctrain.backends import torch_device
from hpctrain.strategies import composition

refuse = composition.offload_rules


def cpu_too(v: dict) -> list[str]:
    if v["runtime"]["device"] == "cuda":
        return refuse(v)
    return refuse({**v, "runtime": {**v["runtime"], "device": "cuda"}})


composition.offload_rules = cpu_too
torch_device.offload_refusal = lambda cfg, why: None  # the start-up's refusal, the same
sys.argv[0] = str(Path(__file__).with_name("tp_train_dump.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
