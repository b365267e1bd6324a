"""Whether a checkpoint was trained as the model this run builds.

Names and shapes are checked elsewhere (reader.require_compatible); this catches what
keeps every shape yet changes what the weights mean: a transformer's `n_heads` (the
same projections split into other heads), an MoE layer's `top_k`. Zoo models only,
their defaults filled in on both sides (a checkpoint's config_yaml records them all,
Config.recorded; earlier versions recorded only the options set); options a resume may
change without changing the model are left out. A user's model is its own code: only
its shapes are checked.
"""

from __future__ import annotations

import yaml

from ..models import zoo
from ..moe.options import moe_options

# Options that change how a model trains or runs, not what its weights mean.
RESUMABLE = ("checkpoint_activations",)
MOE_RESUMABLE = ("capacity_factor", "min_capacity", "drop_tokens", "aux_loss", "jitter")


def _resolved(model_cfg: dict) -> dict | None:
    if not isinstance(model_cfg, dict) or not zoo.is_zoo_model(model_cfg.get("name")):
        return None
    opts = {k: v for k, v in zoo.model_options(model_cfg).items() if k not in RESUMABLE}
    if "moe" in opts:
        moe = moe_options(opts["moe"])
        opts["moe"] = None if moe is None else {
            k: v for k, v in moe.items() if k not in MOE_RESUMABLE
        }  # fmt: skip
    return {"name": model_cfg["name"], **opts}


def model_differences(config_yaml: str | None, model_cfg: dict) -> list[str]:
    """'key: X there, Y now' for each architecture option that differs (empty when the
    checkpoint records no zoo model: an external file, a user's model)."""
    try:
        saved = (yaml.safe_load(config_yaml or "") or {}).get("model")
    except (yaml.YAMLError, AttributeError):
        return []
    before, now = _resolved(saved), _resolved(model_cfg)
    if before is None or now is None:
        return []
    out = []
    for key in sorted(set(before) | set(now)):
        if before.get(key) != now.get(key):
            out.append(f"model.{key}: {before.get(key)!r} there, {now.get(key)!r} now")
    return out
