"""Expert-parallel MoE layer == single-process reference, on every rank of an mpirun job.

usage: moe_layer_check.py BACKEND [BACKEND ...]   (torch, tensorflow)
For k = 1 and 2, with and without dropping: every rank routes its own tokens through
the distributed layer (experts spread over the ranks, real Alltoall/Alltoallv), and
compares outputs, input gradients, router gradients (its own loss) and its experts'
gradients (summed over every rank's tokens) with a float64 torch reference that holds
all experts in one process and implements top-k, capacity and dropping independently
(a plain loop in priority order). Prints "MOE LAYER OK" on rank 0.
"""

import math
import sys

import numpy as np
import torch

from hpctrain.models import zoo
from hpctrain.moe.parallel import ExpertGroup, local_layers
from hpctrain.runtime import run_fail_together, world

E, D, FF, N, T_SEQ, SEED = 4, 8, 16, 3, 8, 7
TOL = 1e-5


def global_spec(opts):
    ffn = {"fc1.weight": (FF, D), "fc1.bias": (FF,), "fc2.weight": (D, FF), "fc2.bias": (D,)}
    params = {"moe.router.weight": (E, D)}
    params.update({f"moe.experts.{e}.{k}": s for e in range(E) for k, s in ffn.items()})
    return zoo.LayerSpec("block", "blocks.0", params, attrs={"n_heads": 1, "moe": opts})


def weights(spec):
    w = zoo.init_weights([spec], SEED)
    w["blocks.0.moe.router.weight"] *= 6.0  # confident, unbalanced router: drops happen
    rng = np.random.default_rng(3)
    for k in w:
        if k.endswith("bias"):  # non-zero biases so their gradients are checked too
            w[k] = rng.normal(0, 0.1, w[k].shape).astype(np.float32)
    return w


def rank_data(r):
    rng = np.random.default_rng(100 + r)
    x = rng.normal(0, 1, (N, T_SEQ, D)).astype(np.float32)
    gy = rng.normal(0, 1, (N, T_SEQ, D)).astype(np.float32)
    return x, gy


def reference(w, opts, size):
    """Per source rank: y, d(loss)/dx, d(loss)/d(router), and expert grads summed over ranks."""
    k, alpha = opts["top_k"], opts["aux_loss"]
    t64 = {n: torch.tensor(v, dtype=torch.float64, requires_grad=True) for n, v in w.items()}
    router = t64["blocks.0.moe.router.weight"]
    tokens = N * T_SEQ
    cap = math.ceil(k * tokens / E * opts["capacity_factor"]) if opts["drop_tokens"] else tokens
    out, expert_grads = [], {n: 0.0 for n in t64 if ".experts." in n}
    for s in range(size):
        xs, gys = rank_data(s)
        x = torch.tensor(xs.reshape(-1, D), dtype=torch.float64, requires_grad=True)
        probs = torch.softmax(x @ router.T, dim=-1)
        top_v, top_i = torch.topk(probs, k, dim=-1)
        gates = top_v if k == 1 else top_v / top_v.sum(-1, keepdim=True)
        fill, routed, dropped = [0] * E, [0] * E, 0
        y = torch.zeros_like(x)
        for slot in range(k):  # first choices before second choices, tokens in order
            for t in range(tokens):
                e = int(top_i[t, slot])
                routed[e] += 1
                if fill[e] >= cap:
                    dropped += 1
                    continue
                fill[e] += 1
                p = f"blocks.0.moe.experts.{e}"
                hid = torch.relu(x[t] @ t64[f"{p}.fc1.weight"].T + t64[f"{p}.fc1.bias"])
                y = y.index_add(
                    0,
                    torch.tensor([t]),
                    (gates[t, slot] * (hid @ t64[f"{p}.fc2.weight"].T + t64[f"{p}.fc2.bias"]))[
                        None
                    ],
                )
        f = torch.tensor(routed, dtype=torch.float64) / (tokens * k)
        aux = alpha * E * (f * probs.mean(0)).sum()
        loss = (y * torch.tensor(gys.reshape(-1, D), dtype=torch.float64)).sum() + aux
        names = list(expert_grads)
        grads = torch.autograd.grad(loss, [x, router, *(t64[n] for n in names)])
        for n, g in zip(names, grads[2:], strict=True):
            expert_grads[n] = expert_grads[n] + g.numpy()
        out.append(
            {
                "y": y.detach().numpy().reshape(N, T_SEQ, D),
                "dx": grads[0].numpy().reshape(N, T_SEQ, D),
                "drouter": grads[1].numpy(),
                "aux": float(aux.detach()),
                "dropped": dropped,
            }
        )
    return out, expert_grads


def run_torch(local, w, x, gy, group):
    from hpctrain.backends import torch_moe
    from hpctrain.backends.groups import ModelGroups
    from hpctrain.backends.torch import _Layer

    layer = _Layer(local, ModelGroups(experts=group))
    with torch.no_grad():
        for name, param in layer.p.items():
            param.copy_(torch.from_numpy(w[f"blocks.0.{name}"]))
    layer.train()
    h = torch.tensor(x, requires_grad=True)
    y = torch_moe.moe_ffn(layer, h)
    aux = torch_moe.aux_loss(layer)
    ((y * torch.from_numpy(gy)).sum() + aux).backward()
    stats = torch_moe.step_extra(layer, 1.0)
    grads = {f"blocks.0.{n}": p.grad.numpy() for n, p in layer.p.items()}
    return y.detach().numpy(), h.grad.numpy(), grads, float(aux.detach()), stats


def run_tensorflow(local, w, x, gy, group):
    import tensorflow as tf

    from hpctrain.backends import tensorflow_moe
    from hpctrain.backends.groups import ModelGroups

    class Net:  # any object with the model's groups: the MoE runtime is keyed by it
        groups = ModelGroups(experts=group)

    net = Net()
    v = {n: tf.Variable(w[f"blocks.0.{n}"]) for n in local.params}

    @tf.function
    def step(h, gy):
        with tf.GradientTape() as tape:
            tape.watch(h)
            y = tensorflow_moe.moe_ffn(net, local, v, h, True)
            aux = tensorflow_moe.aux_loss(net)
            loss = tf.reduce_sum(y * gy) + aux
        grads = tape.gradient(loss, [h, *v.values()])
        return y, aux, grads

    y, aux, grads = step(tf.constant(x), tf.constant(gy))
    stats = tensorflow_moe.step_extra(net, 1.0)
    named = {f"blocks.0.{n}": tf.convert_to_tensor(g).numpy() for n, g in zip(v, grads[1:])}
    return y.numpy(), grads[0].numpy(), named, float(aux), stats


def main():
    for backend in sys.argv[1:]:
        check(backend)


def check(backend):
    w_ = world()
    group = ExpertGroup(w_)  # the whole job
    x, gy = rank_data(group.rank)
    checked = 0
    for k in (1, 2):
        for drop in (True, False):
            opts = {
                "experts": E, "top_k": k, "capacity_factor": 1.0, "min_capacity": 0,
                "drop_tokens": drop, "aux_loss": 0.05, "jitter": 0.0, "every": 1,
            }  # fmt: skip
            spec = global_spec(opts)
            w = weights(spec)
            local = local_layers([spec], SEED, group)[0]
            ref, ref_expert = reference(w, opts, group.size)
            mine = ref[group.rank]
            run = run_torch if backend == "torch" else run_tensorflow
            y, dx, grads, aux, stats = run(local, w, x, gy, group)
            what = f"{backend} k={k} drop={drop} rank {group.rank}/{group.size}"
            np.testing.assert_allclose(y, mine["y"], rtol=0, atol=TOL, err_msg=f"{what}: y")
            np.testing.assert_allclose(dx, mine["dx"], rtol=0, atol=TOL, err_msg=f"{what}: dx")
            np.testing.assert_allclose(
                grads["blocks.0.moe.router.weight"], mine["drouter"], atol=TOL, rtol=0,
                err_msg=f"{what}: router grad",
            )  # fmt: skip
            experts = [n for n in grads if ".experts." in n]
            assert len(experts) == 4 * E // group.size, experts
            for n in experts:
                np.testing.assert_allclose(
                    grads[n], ref_expert[n], rtol=0, atol=TOL, err_msg=f"{what}: {n}"
                )
            assert abs(aux - mine["aux"]) < 1e-6, (what, aux, mine["aux"])
            assert stats["moe_dropped"] == mine["dropped"], (what, stats, mine["dropped"])
            if drop:
                assert w_.allreduce_array(np.array([mine["dropped"]]), "sum")[0] > 0, what
            else:
                assert mine["dropped"] == 0
            checked += 1
    w_.barrier()
    if group.rank == 0:
        print(f"MOE LAYER OK: {backend}, {checked} cases, {group.size} rank(s)")


sys.exit(run_fail_together(main))
