"""Learnable synthetic datasets, so the suite trains something real with no download.

- vectors: Gaussian inputs labelled by a fixed random teacher network (argmax of a
  2-layer tanh MLP): an MLP can learn it well above chance.
- images: each class is a smooth random template, shifted at random and drowned in
  noise: a CNN (translation-equivariant convolutions + global pooling) learns it.
- tokens: sequences from a random, peaked Markov chain: a language model learns the
  transitions; the best achievable next-token accuracy is printed with the data.

Everything is a pure function of the seed; files are written atomically, and a full
disk is one message naming the file and the free space.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import h5py
import numpy as np

from ..errors import DataError
from ..runtime import diskspace
from ..runtime.memory import physical_memory

FORMAT = "hpctrain-dataset-1"
# numpy takes any seed >= 0; the file's `seed` attribute holds at most a uint64
MAX_SEED = 2**64 - 1


def _vectors(rng, n, features, classes):
    hidden = 64
    w1 = rng.normal(0, 1 / np.sqrt(features), (features, hidden))
    w2 = rng.normal(0, 1 / np.sqrt(hidden), (hidden, classes))
    x = rng.normal(0, 1, (n, features)).astype(np.float32)
    y = np.argmax(np.tanh(x @ w1) @ w2, axis=1)
    return x, y.astype(np.int64), {}


def _templates(rng, classes, channels, size):
    """Smooth patterns: a few random low-frequency sinusoids per class and channel."""
    yy, xx = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    out = np.zeros((classes, channels, size, size))
    for c in range(classes):
        for ch in range(channels):
            for _ in range(3):
                fx, fy = rng.integers(1, 4, size=2)
                phase = rng.uniform(0, 2 * np.pi)
                out[c, ch] += np.sin(2 * np.pi * (fx * xx + fy * yy) / size + phase)
    return out / np.sqrt(3)


def _images(rng, n, classes, channels, size, templates):
    y = rng.integers(0, classes, n)
    shifts = rng.integers(0, size, (n, 2))
    x = np.empty((n, channels, size, size), dtype=np.float32)
    for i in range(n):
        x[i] = np.roll(templates[y[i]], tuple(shifts[i]), axis=(1, 2))
    x += rng.normal(0, 1.0, x.shape).astype(np.float32)
    return x, y.astype(np.int64)


def _markov(rng, vocab):
    probs = rng.dirichlet(np.full(vocab, 0.1), size=vocab)
    return probs


def _tokens(rng, n, seq_len, vocab, probs):
    seqs = np.empty((n, seq_len + 1), dtype=np.int64)
    seqs[:, 0] = rng.integers(0, vocab, n)
    cum = np.cumsum(probs, axis=1)
    for t in range(1, seq_len + 1):
        u = rng.random(n)[:, None]
        seqs[:, t] = np.minimum((u > cum[seqs[:, t - 1]]).sum(axis=1), vocab - 1)
    return seqs[:, :-1], seqs[:, 1:]


def generate(
    task: str,
    train: int,
    val: int,
    seed: int,
    classes: int = 10,
    features: int = 32,
    image_size: int = 16,
    channels: int = 3,
    seq_len: int = 32,
    vocab: int = 64,
):
    """{split: (x, y)} plus attributes describing the task."""
    rng = np.random.default_rng(seed)
    n = train + val
    attrs: dict = {"task": task, "seed": seed}
    if task == "vectors":
        x, y, _ = _vectors(rng, n, features, classes)
        attrs["classes"] = classes
    elif task == "images":
        x, y = _images(
            rng, n, classes, channels, image_size, _templates(rng, classes, channels, image_size)
        )
        attrs["classes"] = classes
        attrs["layout"] = "nchw"  # (3, 4, 4) is either reading by its shape alone
    elif task == "tokens":
        probs = _markov(rng, vocab)
        x, y = _tokens(rng, n, seq_len, vocab, probs)
        attrs["classes"] = vocab
        # Best possible next-token accuracy: always guess the likeliest successor.
        attrs["bayes_accuracy"] = float(probs.max(axis=1).mean())
    else:
        raise ValueError(f"unknown synthetic task {task!r}")
    return {"train": (x[:train], y[:train]), "val": (x[train:], y[train:])}, attrs


def write_dataset(path: str | Path, splits: dict, attrs: dict, chunk_rows: int = 256) -> Path:
    """Write /train/{x,y} and /val/{x,y} (row-chunked) atomically to `path`.

    The HDF5 image is built in memory and written with plain writes: HDF5 crashes (a
    segmentation fault) when its file driver meets a full disk, plain writes raise
    ENOSPC. A failed write removes the temporary file and the final name appears only
    after a complete, fsynced write, so a partial data set is never taken for one.
    Raises DataError naming the path and the free space when the disk is full.
    """
    path = Path(path)
    image = io.BytesIO()
    with h5py.File(image, "w") as f:
        f.attrs["format"] = FORMAT
        for key, value in attrs.items():
            f.attrs[key] = value
        for split, (x, y) in splits.items():
            g = f.create_group(split)
            for name, arr in (("x", x), ("y", y)):
                # An empty split (`data synth --val 0`) is stored unchunked: HDF5 refuses
                # a chunk larger than the data.
                chunks = (min(chunk_rows, len(arr)), *arr.shape[1:]) if len(arr) else None
                g.create_dataset(name, data=arr, chunks=chunks)
    data = image.getbuffer()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        problem = diskspace.check_room(path.parent, data.nbytes)
        if problem:
            raise DataError(f"cannot write synthetic dataset {path}: {problem}")
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if diskspace.is_full(exc):
            raise DataError(
                f"cannot write synthetic dataset {path}: {diskspace.no_space(path, data.nbytes)}"
            ) from exc
        raise
    return path


def estimated_bytes(dcfg: dict) -> int:
    """About how many bytes the data set of `dcfg` takes on disk (checked before generating)."""
    n = dcfg["train_samples"] + dcfg["val_samples"]
    if dcfg["task"] == "vectors":
        row = dcfg["features"] * 4 + 8
    elif dcfg["task"] == "images":
        row = dcfg["channels"] * dcfg["image_size"] ** 2 * 4 + 8
    else:
        row = dcfg["seq_len"] * 8 * 2
    return n * row + 64 * 1024  # plus HDF5 metadata


def memory_bytes(dcfg: dict) -> int:
    """About the most memory generating and writing the data set of `dcfg` holds at once:
    the arrays, the HDF5 image built in memory beside them, and the generator's largest
    temporary per sample (float64 draws, the teacher's hidden layer, the Markov rows)."""
    n = dcfg["train_samples"] + dcfg["val_samples"]
    if dcfg["task"] == "vectors":
        temporary = max(dcfg["features"], 64 * 2 + dcfg["classes"]) * 8
    elif dcfg["task"] == "images":
        temporary = dcfg["channels"] * dcfg["image_size"] ** 2 * 8
    else:
        temporary = dcfg["vocab"] * 9
    return 2 * estimated_bytes(dcfg) + n * temporary


def memory_problem(dcfg: dict, asked: str) -> str | None:
    """Why generating the data set of `dcfg` cannot fit in this machine's memory (`asked`
    names the sample counts as the user gave them), or None. Checked before generating:
    a 1e10-sample task otherwise ran out of memory, or into the OOM killer, on rank 0."""
    from ..runtime.diskspace import human

    need, have = memory_bytes(dcfg), physical_memory()
    if have is None or need <= have:
        return None
    return (
        f"{asked}: the {dcfg['task']} data set needs about {human(need)} of memory to "
        f"generate, this machine has {human(have)}: ask for fewer samples"
    )


SYNTHETIC_PREFIX = "synthetic-"  # the cache's file names (a refused run's cache goes)


def synthetic_name(dcfg: dict) -> str:
    """A file name that changes whenever any generator parameter changes."""
    task = dcfg["task"]
    parts = [task, f"n{dcfg['train_samples']}-{dcfg['val_samples']}", f"s{dcfg['seed']}"]
    if task == "vectors":
        parts += [f"f{dcfg['features']}", f"c{dcfg['classes']}"]
    elif task == "images":
        parts += [f"{dcfg['channels']}x{dcfg['image_size']}", f"c{dcfg['classes']}"]
    else:
        parts += [f"t{dcfg['seq_len']}", f"v{dcfg['vocab']}"]
    return SYNTHETIC_PREFIX + "-".join(parts) + ".h5"


def generate_from_config(dcfg: dict):
    return generate(
        dcfg["task"],
        dcfg["train_samples"],
        dcfg["val_samples"],
        dcfg["seed"],
        classes=dcfg["classes"],
        features=dcfg["features"],
        image_size=dcfg["image_size"],
        channels=dcfg["channels"],
        seq_len=dcfg["seq_len"],
        vocab=dcfg["vocab"],
    )
