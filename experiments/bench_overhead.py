"""jaxpar's train step against a minimal hand-written Flax NNX + optax step on one device, then the ZeRO
memory table (measured vs formula) for ZeRO stages 0-3 on data=8.

    python experiments/bench_overhead.py --config configs/tiny.yaml --steps 20 --rounds 3 [key=value ...]

Prints the median per-step time of each, the ratio jaxpar / reference (target <= 1.03), and the tables.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before jax is imported: 8 simulated CPU devices

import argparse  # noqa: E402
import statistics  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.bench import compiled_cost, interleaved_step_times, median_seconds, round_medians  # noqa: E402
from jaxpar.config import load_config  # noqa: E402
from jaxpar.memory import format_memory_table, memory_table  # noqa: E402
from jaxpar.mesh import build_mesh  # noqa: E402
from jaxpar.model import Transformer  # noqa: E402
from jaxpar.train.optimizer import learning_rate_schedule  # noqa: E402
from jaxpar.train.step import build_plan, compute_dtype, init_state, make_train_step  # noqa: E402

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.pipeline=1"]


def reference_step(cfg):
    """Minimal NNX + optax step: token-mean masked CE, value_and_grad, clip + AdamW, jit with donation."""
    graphdef, params = nnx.split(Transformer(cfg.model, nnx.Rngs(cfg.train.seed)))
    o, dtype = cfg.optimizer, compute_dtype(cfg)
    # decay matrices and embeddings only (>= 2 dims besides the stacked `layers` dim of block params)
    decay_mask = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, x: x.ndim - (path[0].key == "blocks") >= 2, p)
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm),
                     optax.adamw(learning_rate_schedule(o, cfg.train.steps), b1=o.b1, b2=o.b2, eps=o.eps,
                                 weight_decay=o.weight_decay, mask=decay_mask))

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["inputs"], dtype).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(ce * batch["loss_mask"]) / jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, params, tx.init(params)


def random_batch(cfg, sharding, seed: int = 0) -> dict:
    g, t, v = cfg.train.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    k1, k2 = jax.random.split(jax.random.key(seed))
    batch = {"inputs": jax.random.randint(k1, (g, t), 0, v, jnp.int32),
             "targets": jax.random.randint(k2, (g, t), 0, v, jnp.int32),
             "loss_mask": jnp.ones((g, t), jnp.float32).at[:, : t // 8].set(0.0)}
    return jax.device_put(batch, sharding)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round and contender")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.n_layers=2")
    args = ap.parse_args()

    devices = jax.devices()[:1]
    cfg = load_config(args.config, args.overrides + ONE_DEVICE, num_devices=1)
    plan = build_plan(cfg, build_mesh(cfg, devices))
    batch = random_batch(cfg, plan.batch_sharding)
    jp = {"state": init_state(plan, cfg.train.seed)}
    ref_step, params, opt_state = reference_step(cfg)
    ref = {"params": jax.device_put(params, devices[0]), "opt": jax.device_put(opt_state, devices[0])}
    # compile both ahead of time; the timed calls run these executables (donation included)
    jp["step"] = make_train_step(plan).lower(jp["state"], batch).compile()
    ref_step = ref_step.lower(ref["params"], ref["opt"], batch).compile()

    def run_jaxpar():
        jp["state"], metrics = jp["step"](jp["state"], batch)
        return metrics["loss"]

    def run_reference():
        ref["params"], ref["opt"], loss = ref_step(ref["params"], ref["opt"], batch)
        return loss

    print(f"device: {devices[0].device_kind} ({jax.default_backend()}); model {cfg.model.n_layers} layers, "
          f"d_model {cfg.model.d_model}, batch {cfg.train.global_batch_size} x {cfg.data.seq_len} tokens, "
          f"layout {cfg.precision.layout}, compute {jnp.dtype(plan.compute_dtype).name}")
    jc, rc = compiled_cost(jp["step"]), compiled_cost(ref_step)
    print(f"XLA cost estimate jaxpar/reference: FLOPs {jc['flops'] / rc['flops']:.4f}, "
          f"bytes accessed {jc['bytes_accessed'] / rc['bytes_accessed']:.4f}")
    print(f"first-step loss: jaxpar {float(run_jaxpar()):.6f}  reference {float(run_reference()):.6f}")
    times = interleaved_step_times({"jaxpar": run_jaxpar, "reference": run_reference}, args.steps, args.rounds)
    med = {name: median_seconds(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:<9} per-round medians (ms): " + " ".join(f"{m * 1e3:.2f}" for m in round_medians(t)))
    ratio = med["jaxpar"] / med["reference"]
    paired = statistics.median(j / r for j, r in zip(round_medians(times["jaxpar"]),
                                                     round_medians(times["reference"])))
    print(f"median step ({args.rounds} rounds x {args.steps} steps): jaxpar {med['jaxpar'] * 1e3:.2f} ms, "
          f"reference {med['reference'] * 1e3:.2f} ms")
    print(f"ratio jaxpar/reference: {ratio:.3f} (of medians), {paired:.3f} (median of per-round ratios; "
          "robust to load drift with many short rounds); target <= 1.03")

    if len(jax.devices()) < 8:
        print(f"memory table skipped: needs 8 devices, have {len(jax.devices())}")
        return
    for zero in range(4):
        mcfg = load_config(args.config, args.overrides + ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1",
                                                          "mesh.pipeline=1", f"optimizer.zero_stage={zero}"],
                           num_devices=8)
        mplan = build_plan(mcfg, build_mesh(mcfg))
        state = jax.eval_shape(lambda: init_state(mplan, 0))
        mbatch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=mplan.batch_sharding)
                  for k, v in batch.items()}  # abstract: the tables are compiled, never run
        print()
        print(format_memory_table(memory_table(mplan, state, mbatch)))


if __name__ == "__main__":
    main()
