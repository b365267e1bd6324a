"""Raw Horovod + PyTorch trained on the demo task until the end, accuracy every epoch.

The time-to-accuracy baseline: the demo's data (hpctrain's synthetic generator, same
seed and sizes), the same zoo model, Adam with the demo's learning rate scaled by
sqrt(ranks), one warm-up epoch then a cosine, per-rank batch 128, each rank a shuffled
1/N of the samples every epoch. Horovod's recipe (DistributedOptimizer, broadcast of the
parameters) with its defaults, `--fp16` for `Compression.fp16`. Writes the wall time
since the first step and the validation accuracy after every epoch.

    mpirun -np 2 python benchmarks/baselines/raw_horovod_demo.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.backends.torch import build_model
from hpctrain.data import synthetic
from hpctrain.models.zoo import InputSpec


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", default="256,256", help="the mlp's hidden widths")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--train-samples", type=int, default=65536)
    p.add_argument("--val-samples", type=int, default=8192)
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=128, help="per rank")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fp16", action="store_true", help="Compression.fp16")
    p.add_argument("--json", required=True)
    return p.parse_args()


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()
    splits, _ = synthetic.generate(
        "vectors", args.train_samples, args.val_samples, args.data_seed, features=args.features
    )
    (x, y), (vx, vy) = splits["train"], splits["val"]
    hidden = [int(h) for h in args.hidden.split(",")]
    model = build_model({"name": "mlp", "hidden": hidden}, InputSpec((args.features,), 10), seed=0)
    peak = args.lr * math.sqrt(size)
    # fused, as hpctrain's (backends/torch_steps.make_optimizer): the same kernel
    optimizer = torch.optim.Adam(model.parameters(), lr=peak, fused=True)
    compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    steps = len(x) // (args.batch_size * size)
    total, warmup = steps * args.epochs, steps

    def lr_at(step):
        if step < warmup:
            return args.lr + (peak - args.lr) * step / warmup
        return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    epochs, step, t0 = [], 0, time.monotonic()
    vx_t, vy_t = torch.from_numpy(vx[rank::size]), torch.from_numpy(vy[rank::size])
    for epoch in range(args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x))[rank::size]
        model.train()
        for i in range(steps):
            rows = np.sort(order[i * args.batch_size : (i + 1) * args.batch_size])
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(torch.from_numpy(x[rows])), torch.from_numpy(y[rows]))
            loss.backward()
            optimizer.step()
            step += 1
        model.eval()
        with torch.no_grad():
            right = (model(vx_t).argmax(1) == vy_t).sum().float()
        counts = hvd.allreduce(torch.stack([right, torch.tensor(float(len(vy_t)))]), op=hvd.Sum)
        accuracy = float(counts[0] / counts[1])
        epochs.append(
            {"epoch": epoch + 1, "seconds": time.monotonic() - t0, "val_accuracy": accuracy}
        )
        if rank == 0:
            print(f"epoch {epoch + 1}: val accuracy {accuracy:.4f}", flush=True)
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump({"name": "raw Horovod", "fp16": args.fp16, "epochs": epochs}, f)


if __name__ == "__main__":
    main()
