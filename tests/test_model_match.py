"""A checkpoint trained as another model whose shapes all match is refused on resume
(checkpoint/model_match.py): the weights would mean something else."""

from __future__ import annotations

import yaml

from hpctrain.checkpoint.model_match import model_differences

T = {"name": "transformer", "d_model": 16, "n_layers": 1, "d_ff": 16}


def _saved(model: dict) -> str:
    return yaml.safe_dump({"model": model, "train": {"epochs": 1}})


def test_shape_keeping_architecture_changes_are_named():
    assert model_differences(_saved({**T, "n_heads": 4}), {**T, "n_heads": 2}) == [
        "model.n_heads: 4 there, 2 now"
    ]
    moe = {"experts": 4, "top_k": 2}
    found = model_differences(_saved({**T, "moe": moe}), {**T, "moe": {**moe, "top_k": 1}})
    assert len(found) == 1 and found[0].startswith("model.moe: {")


def test_defaults_and_options_a_resume_may_change_are_not_differences():
    assert model_differences(_saved({**T, "n_heads": 4}), dict(T)) == []  # 4 is the default
    moe = {"experts": 4, "jitter": 0.1}
    now = {**T, "checkpoint_activations": True, "moe": {"experts": 4, "capacity_factor": 2.0}}
    assert model_differences(_saved({**T, "moe": moe}), now) == []


def test_no_zoo_model_or_no_config_is_left_to_the_shape_check():
    assert model_differences(None, T) == []
    assert model_differences(_saved({"name": "mine:Net"}), {"name": "mine:Net", "x": 1}) == []
    assert model_differences("not: [valid", T) == []
