"""User models: `model.name: package.module:function`, found, called and checked.

Framework-free: this module imports the user's module and reads the function's
signature; the backends (`backends/torch_user.py`, `backends/tensorflow_user.py`) call
the function and run one checked forward pass. Every problem is a one-line ConfigError
naming `model.name`, so a job stops on every rank with the reason, not a traceback.

Rules (docs/bring-your-own.md):
- The directory hpctrain was started from is importable, as `python -m` would make it.
  Anything else must be on PYTHONPATH on every rank (`mpirun -x PYTHONPATH`; srun
  passes the environment on by default).
- The function is called with the `model.*` options as keyword arguments, plus the
  data's facts when its signature names them: `input_shape` (one sample, in the
  backend's layout), `classes` / `num_classes` / `n_classes` (classes, or vocabulary).
- Options the signature does not accept are named (unless it takes **kwargs), and so
  are required parameters nobody supplies.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable

from ..errors import ConfigError

SHAPE_ARGS = ("input_shape",)
CLASS_ARGS = ("classes", "num_classes", "n_classes")
PATH_HINT = (
    "put its directory on PYTHONPATH on every rank (mpirun -x PYTHONPATH=...; srun "
    "passes the environment on) or start hpctrain from the directory that holds it"
)


class ModelNotFound(ConfigError):
    """The model's module, one it imports or a shared library it loads is not on this
    host: another (a job's node) may have it, which `hpctrain config` notes instead of
    refusing (the run refuses)."""


def split_reference(name: str) -> tuple[str, str]:
    """'pkg.module:function' -> ('pkg.module', 'function'), or a ConfigError."""
    module, sep, function = name.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ConfigError(
            f"model.name {name!r}: expected a zoo model (mlp, cnn, resnet, transformer) "
            "or 'package.module:function'"
        )
    return module, function


def ensure_cwd_importable(cwd: str | None = None) -> None:
    """Put the start directory on sys.path, as `python script.py` or `python -m` would.

    The `hpctrain` console script puts only its own bin/ there, so `mymodels.py` beside
    the user's config would otherwise not be found.
    """
    cwd = os.path.abspath(cwd or os.getcwd())
    if cwd not in (os.path.abspath(p or ".") for p in sys.path):
        sys.path.insert(0, cwd)


def resolve(name: str) -> Callable:
    """The user's model function for `model.name`; ConfigError says why it cannot be had."""
    module_name, fn_name = split_reference(name)
    ensure_cwd_importable()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ModelNotFound(
                f"model.name {name}: cannot import {module_name!r} (no module named "
                f"{missing!r} on this rank's path): {PATH_HINT}"
            ) from exc
        raise ModelNotFound(
            f"model.name {name}: importing {module_name!r} needs {missing!r}, which is not "
            "installed on this rank"
        ) from exc
    except (ImportError, OSError) as exc:  # a shared library this host lacks (libcudart.so)
        raise ModelNotFound(
            f"model.name {name}: importing {module_name!r} raised {_one_line(exc)} on this "
            "host (--verbose shows the traceback)"
        ) from exc
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's module failed (argparse)
        raise ConfigError(
            f"model.name {name}: importing {module_name!r} raised {_one_line(exc)} "
            "(--verbose shows the traceback)"
        ) from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(
            f"model.name {name}: {module_name} ({_origin(module)}) has no {fn_name!r} "
            f"(callables there: {', '.join(public) or 'none'})"
        )
    if not callable(fn):
        raise ConfigError(f"model.name {name}: {fn_name} is a {type(fn).__name__}, not callable")
    return fn


def builder_kwargs(
    fn: Callable, model_cfg: dict, input_shape: tuple[int, ...], classes: int
) -> dict:
    """Keyword arguments for the user's function: its options plus the data's facts.

    An explicit `model.<option>` wins over the data's fact of the same name (the
    checked forward pass then says when the two disagree).
    """
    name = model_cfg["name"]
    options = {k: v for k, v in model_cfg.items() if k != "name"}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and C callables: pass options as given
        return options
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {
        k: p
        for k, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    leftover = [k for k in options if k not in named]
    if leftover and not takes_any:
        keys = ", ".join(f"model.{k}" for k in leftover)
        raise ConfigError(
            f"model.name {name}: {fn.__name__} has no parameter for {keys} (its "
            f"parameters: {', '.join(named) or 'none'}); remove the option(s) from the "
            "config or add them to the function"
        )
    kwargs = dict(options)
    facts = {**{k: tuple(input_shape) for k in SHAPE_ARGS}, **{k: classes for k in CLASS_ARGS}}
    for key, value in facts.items():
        if key in named and key not in kwargs:
            kwargs[key] = value
    missing = [
        k for k, p in named.items() if p.default is inspect.Parameter.empty and k not in kwargs
    ]
    if missing:
        raise ConfigError(
            f"model.name {name}: {fn.__name__} needs {', '.join(missing)} and nothing "
            f"supplies {'it' if len(missing) == 1 else 'them'}: set "
            f"{', '.join(f'model.{k}' for k in missing)} (hpctrain itself passes only "
            f"{', '.join((*SHAPE_ARGS, *CLASS_ARGS))})"
        )
    return kwargs


def check_user_model(model_cfg: dict, input_shape: tuple[int, ...], classes: int) -> str | None:
    """Why this user model cannot be built (import, function, options), or None.

    For a pre-check on every rank before any framework work, agreed over ranks by the
    caller (`world.agree(check_user_model(...))`), so a module missing on one node
    stops the whole job with that node's ranks named instead of a hang.
    """
    try:
        builder_kwargs(resolve(model_cfg["name"]), model_cfg, input_shape, classes)
    except ConfigError as exc:
        return str(exc)
    return None


def call_builder(fn: Callable, name: str, kwargs: dict):
    """Call the user's function; its own exceptions become one line naming it."""
    try:
        return fn(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the user's code failed
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(
            f"model.name {name}: {fn.__name__}({shown}) raised {_one_line(exc)} "
            "(--verbose shows the traceback)"
        ) from exc


def mismatch_message(
    name: str,
    sample_shape: tuple[int, ...],
    classes: int,
    tokens: bool,
    out_shape: tuple[int, ...] | None,
    error: BaseException | None = None,
) -> str | None:
    """Why one forward pass of a batch of 2 samples does not fit the data, or None.

    Classification needs logits of shape (2, classes); token models (2, seq, vocab).
    """
    batch = (2, *sample_shape)
    if error is not None:
        return (
            f"model.name {name}: a forward pass on a batch of shape {batch} failed: "
            f"{_one_line(error)}; the data's samples have shape {tuple(sample_shape)} "
            f"(accept an `input_shape` argument to size the model from the data)"
        )
    want = (2, sample_shape[0], classes) if tokens else (2, classes)
    if tuple(out_shape or ()) == want:
        return None
    what = "vocabulary" if tokens else "classes"
    return (
        f"model.name {name}: output shape {tuple(out_shape or ())} for a batch of shape "
        f"{batch}, but the data needs {want} ({classes} {what}); make the last layer "
        f"produce {classes} outputs (accept a `classes` argument to get the number)"
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _origin(module) -> str:
    return getattr(module, "__file__", None) or "built-in"
