"""The `model.moe` options: defaults, validation and the capacity rule (no framework, no MPI).

Kept apart from the MPI code so that config validation (which runs on every rank before
MPI work starts) can check a `moe` mapping without importing mpi4py.
"""

from __future__ import annotations

import math

# model.moe.<key> and its default; `model.moe: null` (the default) means no experts.
MOE_DEFAULTS: dict = {
    "experts": 4,  # E, spread evenly over the ranks (E divisible by the number of ranks)
    "top_k": 2,  # experts per token (1 = Switch, 2 = GShard)
    "capacity_factor": 1.25,  # capacity = ceil(k * tokens / E * capacity_factor)
    "min_capacity": 4,  # lower bound of the capacity
    "drop_tokens": True,  # false: capacity = tokens, nothing is dropped
    "aux_loss": 0.01,  # alpha of the Switch load-balancing loss alpha * E * sum_i f_i P_i
    "jitter": 0.0,  # router input multiplied by U(1 - jitter, 1 + jitter) while training
    "every": 1,  # MoE in every `every`-th block (blocks every-1, 2*every-1, ...)
}

_INTS = {"experts": 1, "top_k": 1, "min_capacity": 0, "every": 1}  # key -> minimum
# Past this, building the model's layer list alone took minutes in silence (1e5-1e9 were
# tried); models with experts have up to hundreds of them.
MAX_EXPERTS = 65536


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_moe(value, prefix: str = "model.moe") -> list[str]:
    """Problems with a `model.moe` mapping, each naming its key (empty when fine)."""
    if value is None:
        return []
    if not isinstance(value, dict):
        return [f"{prefix}: expected a mapping of MoE options or null, got {value!r}"]
    problems = [
        f"{prefix}.{k}: unknown MoE option (known: {', '.join(sorted(MOE_DEFAULTS))})"
        for k in value
        if k not in MOE_DEFAULTS
    ]
    opts = {**MOE_DEFAULTS, **value}
    for key, minimum in _INTS.items():
        if not (_is_int(opts[key]) and opts[key] >= minimum):
            problems.append(f"{prefix}.{key}: expected an integer >= {minimum}, got {opts[key]!r}")
    if _is_int(opts["experts"]) and opts["experts"] > MAX_EXPERTS:
        problems.append(f"{prefix}.experts: at most {MAX_EXPERTS}, got {opts['experts']}")
    if not (_is_num(opts["capacity_factor"]) and opts["capacity_factor"] > 0):
        problems.append(
            f"{prefix}.capacity_factor: must be a number > 0, got {opts['capacity_factor']!r}"
        )
    if not (_is_num(opts["aux_loss"]) and opts["aux_loss"] >= 0):
        problems.append(f"{prefix}.aux_loss: must be a number >= 0, got {opts['aux_loss']!r}")
    if not (_is_num(opts["jitter"]) and 0 <= opts["jitter"] < 1):
        problems.append(f"{prefix}.jitter: must be a number in [0, 1), got {opts['jitter']!r}")
    if not isinstance(opts["drop_tokens"], bool):
        problems.append(
            f"{prefix}.drop_tokens: expected true or false, got {opts['drop_tokens']!r}"
        )
    if not problems and opts["top_k"] not in (1, 2):
        problems.append(f"{prefix}.top_k: must be 1 or 2, got {opts['top_k']}")
    if not problems and opts["top_k"] > opts["experts"]:
        problems.append(
            f"{prefix}.top_k: {opts['top_k']} experts per token but only "
            f"{opts['experts']} expert(s) (model.moe.experts)"
        )
    return problems


def moe_options(value) -> dict | None:
    """The options with defaults filled in, or None when MoE is off."""
    return None if value is None else {**MOE_DEFAULTS, **value}


def is_moe_block(opts: dict | None, index: int) -> bool:
    """Whether transformer block `index` gets the MoE feed-forward."""
    return opts is not None and index % opts["every"] == opts["every"] - 1


def capacity(tokens: int, experts: int, top_k: int, factor: float, minimum: int, drop: bool) -> int:
    """Tokens one expert accepts from one rank's batch: ceil(k*T/E*factor), >= minimum.

    Never above T (a token picks distinct experts, so no expert can be offered more);
    with drop_tokens false it is T, so nothing is ever dropped. The 1e-9 guards against
    float noise turning an exact integer like 20*1.2/4 into the next one up.
    """
    if not drop:
        return tokens
    cap = math.ceil(top_k * tokens / experts * factor - 1e-9)
    return int(min(tokens, max(minimum, cap)))
