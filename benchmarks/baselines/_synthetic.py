"""What every baseline shares: Horovod's synthetic-benchmark flags, timing and output.

Kept apart so each baseline script shows only its training step, the thing compared.
The flags, the timing loop (`timeit` over `--num-batches-per-iter` batches, after
`--num-warmup-batches`) and the printed lines follow Horovod's
examples/pytorch/pytorch_synthetic_benchmark.py, so numbers line up with it.
"""

from __future__ import annotations

import argparse
import json
import timeit

import numpy as np

from hpctrain.models.zoo import InputSpec


def parse_args(description: str, add=None) -> argparse.Namespace:
    """Horovod's synthetic-benchmark flags; `add(parser)` adds a script's own."""
    p = argparse.ArgumentParser(description=description)
    if add is not None:
        add(p)
    p.add_argument("--model", default="cnn", help="zoo model (mlp, cnn, resnet)")
    p.add_argument(
        "--opt", action="append", default=[], metavar="KEY=VALUE", help="model option (YAML)"
    )
    p.add_argument("--task", default="images", choices=("images", "vectors"))
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    p.add_argument("--json", default=None, help="write the per-iteration numbers here")
    return p.parse_args()


def model_cfg(args) -> dict:
    """The zoo model section: name plus `--opt key=value` options (values read as YAML)."""
    import yaml

    cfg = {"name": args.model}
    for text in args.opt:
        key, value = text.split("=", 1)
        cfg[key] = yaml.safe_load(value)
    return cfg


def input_spec(args) -> InputSpec:
    if args.task == "vectors":
        return InputSpec((args.features,), args.classes)
    return InputSpec((3, args.image_size, args.image_size), args.classes)


def fixed_batch(args, seed: int = 0):
    """One random batch reused every step (Horovod's synthetic data)."""
    rng = np.random.default_rng(seed)
    inp = input_spec(args)
    x = rng.standard_normal((args.batch_size, *inp.shape)).astype(np.float32)
    y = rng.integers(0, inp.classes, args.batch_size).astype(np.int64)
    return x, y


def run(step, args, rank: int, size: int, name: str) -> dict:
    """Warm up, time `--num-iters` iterations, print Horovod's lines, write JSON."""

    def log(text):
        if rank == 0:
            print(text, flush=True)

    log(f"{name}: model {args.model}, batch size {args.batch_size}, {size} rank(s)")
    timeit.timeit(step, number=args.num_warmup_batches)
    img_secs = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)
    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} CPU(s): {size * mean:.1f} +-{size * conf:.1f}")
    result = {"name": name, "model": args.model, "size": size, "img_secs": img_secs}
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return result
