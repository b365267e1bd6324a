"""A user's torch model (`model.name: module:function`): built, then one checked forward.

The function gets `input_shape` in torch's layout (images channels first: C, H, W) and
the number of classes when its signature asks (hpctrain/models/user.py). A forward pass
on a batch of 2 zero samples, in eval mode and without gradients (no BatchNorm running
statistics move), proves before training that the model takes the data's samples and
returns one logit per class; a mismatch is one line naming both shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..models import user, zoo


def build_user_model(model_cfg: dict, inp: zoo.InputSpec, seed: int) -> nn.Module:
    """The user's nn.Module, seeded, with its input and output sizes checked."""
    name = model_cfg["name"]
    fn = user.resolve(name)
    kwargs = user.builder_kwargs(fn, model_cfg, inp.shape, inp.classes)
    torch.manual_seed(seed)
    model = user.call_builder(fn, name, kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name {name}: returned {type(model).__name__}, not a torch nn.Module "
            "(backend: torch)"
        )
    check_forward(model, name, inp)
    return model


def check_forward(model: nn.Module, name: str, inp: zoo.InputSpec) -> None:
    """ConfigError unless a batch of 2 samples gives logits of the data's shape."""
    x = torch.zeros((2, *inp.shape), dtype=torch.int64 if inp.tokens else torch.float32)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as exc:  # noqa: BLE001 - any failure here is a size mismatch to report
        raise ConfigError(
            user.mismatch_message(name, inp.shape, inp.classes, inp.tokens, None, exc)
        ) from exc
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"model.name {name}: forward returned {type(out).__name__}; hpctrain needs one "
            "tensor of logits"
        )
    problem = user.mismatch_message(name, inp.shape, inp.classes, inp.tokens, tuple(out.shape))
    if problem:
        raise ConfigError(problem)


def decorrelate_ranks(seed: int, rank: int) -> None:
    """After the build, which seeded every rank alike (equal initial weights), rank
    `rank`'s own random stream for its random layers (dropout): replicas see different
    samples, so their masks must differ as one process's do across its batch. Rank 0
    keeps the stream it has (one process trains as before)."""
    if rank:
        torch.manual_seed(seed + rank)
