"""Save checkpoints in a loop (killed from outside, or by the test-only kill hook).

usage: ckpt_writer.py DIR FIRST_STEP COUNT MB; prints 'saved <step>' after each save.
"""

import sys

import numpy as np

from hpctrain.checkpoint import capture_process_rng, save
from hpctrain.runtime.faults import Faults


def state_of(step: int, mb: float) -> dict:
    """Arrays whose contents depend on the step, so files of different steps differ."""
    rng = np.random.default_rng(step)
    n = max(1, int(mb * 1e6 / 4 / 8))
    state = {f"model/layer{i}.weight": rng.standard_normal(n).astype(np.float32) for i in range(8)}
    state["optimizer/step"] = np.array(step)
    return state


def main() -> None:
    directory, first, count, mb = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        float(sys.argv[4]),
    )
    faults = Faults.from_env()  # the test's HPCTRAIN_FAULT_KILL_DURING_SAVE
    for k in range(count):
        step = first + 10 * k
        rng = {0: capture_process_rng()}
        save(directory, step, state_of(step, mb), {"step": step}, rng, faults=faults)
        print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
