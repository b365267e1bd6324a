"""Image layout: channels first (NCHW, what hpctrain feeds models) or last (NHWC).

`data.layout: nchw | nhwc` says how the file stores images; `auto` (the default) decides
from the sample shape only when one reading is plausible and the other is not:
channels are few (at most MAX_CHANNELS) or the two spatial sides are equal. So
(3, 32, 32) is NCHW, (32, 32, 3) NHWC, (28, 28) a single-channel image for a
convolutional model; (3, 3, 3) or (16, 16, 16) are refused with the choice to make,
rather than guessed (a wrong guess trains at chance level without any error).

A file may declare its layout in a root attribute `layout` (`nchw` or `nhwc`), which
`auto` then takes (hpctrain's synthetic images say `nchw`: (3, 4, 4) fits both readings).

A model that flattens its input (zoo `mlp`) does not care, so no layout is decided.
"""

from __future__ import annotations

from ..errors import DataError

MAX_CHANNELS = 4  # gray, gray+alpha, RGB, RGBA
LAYOUTS = ("auto", "nchw", "nhwc")


def _nchw_plausible(shape) -> bool:
    c, h, w = shape
    return c <= MAX_CHANNELS or h == w


def _nhwc_plausible(shape) -> bool:
    h, w, c = shape
    return c <= MAX_CHANNELS or h == w


def declared(option: str, attribute) -> str:
    """data.layout, or under `auto` the layout the file declares in a root attribute
    `layout` (nchw or nhwc: hpctrain's synthetic images say nchw)."""
    if option == "auto" and isinstance(attribute, bytes):
        attribute = attribute.decode("utf-8", "replace")
    if option == "auto" and attribute in ("nchw", "nhwc"):
        return attribute
    return option


def decide_layout(where: str, sample: tuple[int, ...], option: str, model_kind: str) -> str | None:
    """How stored samples become (C, H, W): 'nchw', 'nhwc', 'hw' (add a channel) or None.

    None: the samples are passed on as stored (not images, or a flattening model).
    """
    convolutional = model_kind in ("images", "user")
    if len(sample) == 2 and model_kind == "images":
        return "hw"  # (H, W) gray images for a convolutional zoo model
    if len(sample) != 3 or model_kind == "tokens":
        if option != "auto" and model_kind != "tokens":
            raise DataError(
                f"{where}: data.layout is {option} but samples have shape {tuple(sample)}, "
                "not images (C, H, W) or (H, W, C)"
            )
        return None
    if option != "auto":
        return option
    first, last = _nchw_plausible(sample), _nhwc_plausible(sample)
    if first and not last:
        return "nchw"
    if last and not first:
        return "nhwc"
    if not convolutional:
        return None  # an mlp flattens: either reading trains the same
    reading = (
        "could be channels first or channels last"
        if first
        else "has neither few channels nor square sides either way"
    )
    raise DataError(
        f"{where}: cannot tell the image layout: samples {tuple(sample)} {reading}; set "
        "data.layout to nchw or nhwc"
    )


def model_shape(sample: tuple[int, ...], layout: str | None) -> tuple[int, ...]:
    """One sample's shape as the model gets it."""
    if layout == "nhwc":
        h, w, c = sample
        return (c, h, w)
    if layout == "hw":
        return (1, *sample)
    return tuple(sample)


def to_model_layout(x, layout: str | None):
    """A batch (N, ...) in the stored layout -> (N, C, H, W) for the model."""
    import numpy as np

    if layout == "nhwc":
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if layout == "hw":
        return x[:, None]
    return x


def describe(layout: str | None) -> str | None:
    return {
        "nchw": "NCHW",
        "nhwc": "NHWC, fed as NCHW",
        "hw": "(H, W), fed as (1, H, W)",
    }.get(layout)
