"""Shared pieces of the train-step tests: a tiny model config, meshes, batches, compilation and comparison.

Shape letters: G global batch (sequences), T sequence length, L layers, D model width, F mlp hidden width.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

import jax
import numpy as np
from optax import tree_utils as otu

from jaxpar.analysis.hlo.compile_options import FAST_COMPILER_OPTIONS as FAST_COMPILE
from jaxpar.config import load_config
from jaxpar.data.batch import BATCH_KEYS
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.optimizer import weight_decay_mask
from jaxpar.training.plan import StepPlan, build_plan
from jaxpar.training.step import _grad_fn_with_moe, make_grad_fn, make_train_step

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "tiny.yaml")
# Compile time (not the model) dominates these tests, so the model is as small as the checks allow:
# d_model = 64 divides by 8 for every state sharding, vocab 264 is the byte tokenizer's minimum.
TINY = (
    "mesh.tensor=1",
    "model.n_layers=2",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=128",
    "data.seq_len=8",
)
# The compared step is the optimizer's first, at the schedule's peak rate: no warmup. Adam keeps its default
# eps (1e-8); `assert_adam_step_close` carries the gradients' tolerance through Adam's conditioning.
FIRST_STEP_AT_PEAK = ("optimizer.warmup_steps=0",)
FP32 = ("precision.compute_dtype=float32", "precision.layout=fp32")
VOCAB = 264


COMPILE_CACHE_VAR = "JAXPAR_TEST_COMPILE_CACHE"  # the run's shared compilation cache directory (tests/conftest.py)


def child_env(*, drop: Sequence[str] = (), compile_cache: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a subprocess a test starts: this process's without JAX_NUM_CPU_DEVICES (the command
    sets its own device count) and the names in `drop`, plus `extra`.

    compile_cache: point jax's persistent compilation cache at the test run's shared directory, so that processes
    compiling the same step (every launch of a multi-process test compiles it in each process) compile it once.
    Only for commands whose steps have no pipeline stages: XLA:CPU deadlocks in a pipelined step loaded from the
    cache, and jaxpar refuses that combination (`jaxpar.training.plan.build_plan`)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES" and k not in drop}
    if compile_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ[COMPILE_CACHE_VAR]
    return {**env, **extra}


def make_plan(overrides: Sequence[str], devices: Sequence[jax.Device], **plan_kw) -> StepPlan:
    """The step plan of tiny.yaml + TINY + `overrides` on a mesh over `devices`; `plan_kw` go to `build_plan`
    (loss_fn=, optimizer=, learning_rate=)."""
    cfg = load_config(CONFIG, [*TINY, *overrides], num_devices=len(devices))
    return build_plan(cfg, build_mesh(cfg, devices), **plan_kw)


def planner(*base: str, **defaults) -> Callable[..., StepPlan]:
    """A test file's plan maker: `plan(overrides, n, **plan_kw)` is `make_plan` of `base` + `overrides` on the
    first n devices, `build_plan` given `defaults` updated by `plan_kw`."""

    def plan(overrides: Sequence[str] = (), n: int = 1, **plan_kw) -> StepPlan:
        return make_plan([*base, *overrides], jax.devices()[:n], **{**defaults, **plan_kw})

    return plan


def host_batch(valid_per_row: Sequence[int], seq_len: int, seed: int) -> dict:
    """Random token batch of len(valid_per_row) rows; row i has its first valid_per_row[i] tokens valid."""
    rng = np.random.default_rng(seed)
    g = len(valid_per_row)
    mask = (np.arange(seq_len)[None, :] < np.asarray(valid_per_row)[:, None]).astype(np.float32)
    return {
        "inputs": rng.integers(0, VOCAB, (g, seq_len), dtype=np.int32),
        "targets": rng.integers(0, VOCAB, (g, seq_len), dtype=np.int32),
        "loss_mask": mask,
    }


def device_batch(plan: StepPlan, batch: dict) -> dict:
    """Puts a host batch on the plan's mesh, rows split over data x fsdp."""
    return {k: jax.device_put(batch[k], plan.batch_sharding) for k in BATCH_KEYS}


def to_host(tree):
    """A numpy copy of a tree of arrays (take it before a donating step consumes the arrays)."""
    return jax.tree.map(lambda x: np.array(x), tree)


# FAST_COMPILE (jaxpar.analysis.hlo.compile_options.FAST_COMPILER_OPTIONS) cuts XLA:CPU compile time of a step 3-4x
# (compile time, not the model, dominates these tests). HLO passes (SPMD partitioning, collectives, fusion
# decisions) still run, so the program compared is the program shipped; only its machine code is less
# optimised. Both sides of every comparison compile this way.


def compile_fast(jitted, *args):
    """Ahead-of-time compiles `jitted` (a `jax.jit` object) for `args` with `FAST_COMPILE`. The compiled
    executable keeps the jit's shardings and donation."""
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)


def one_adam_step(plan: StepPlan, state: dict, batch: dict, moe_sums: bool = False) -> dict:
    """Gradients of `make_grad_fn`, then one train step of `plan` (an Adam-family optimizer), both compiled with
    `FAST_COMPILE`; `state` is consumed.

    Returns host copies: "grads", "grad_loss", "grad_tokens" (make_grad_fn's outputs), "params0" (before the
    step), "metrics", "params", "mu", "nu" (after it); and on the devices "grads_shardings" (a tree of each
    gradient's sharding) and "new_state". With `moe_sums` the gradients come from the function behind
    `make_grad_fn` that also returns the step's MoE sums (`jaxpar.training.moe_loss`), kept as "moe_sums".
    """
    grad_fn = _grad_fn_with_moe(plan) if moe_sums else make_grad_fn(plan)
    grad_fn = compile_fast(jax.jit(grad_fn), state["params"], batch)
    step = compile_fast(make_train_step(plan), state, batch)
    grads, loss, n_tokens, *sums = grad_fn(state["params"], batch)
    out = {
        "grads": to_host(grads),
        "grad_loss": float(loss),
        "grad_tokens": float(n_tokens),
        "grads_shardings": jax.tree.map(lambda g: g.sharding, grads),
        "params0": to_host(state["params"]),
    }
    if moe_sums:
        out["moe_sums"] = to_host(sums[0])
    new, metrics = step(state, batch)
    out.update(
        metrics=to_host(metrics),
        params=to_host(new["params"]),
        new_state=new,
        mu=to_host(otu.tree_get(new["opt_state"], "mu")),
        nu=to_host(otu.tree_get(new["opt_state"], "nu")),
    )
    return out


@contextlib.contextmanager
def quick_compile():
    """Within: every compile skips LLVM optimisation (`jax_disable_most_optimizations`), which makes the
    library's internal jits (`init_state`) compile 4-6x faster; see `FAST_COMPILE` for why that is sound."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def spec_axes(sharding) -> set[str]:
    """Mesh axis names that a NamedSharding's PartitionSpec splits over (size-1 axes included)."""
    out = set()
    for entry in sharding.spec:
        out.update((entry,) if isinstance(entry, str) else tuple(entry or ()))
    return out


def shard_shape(x: jax.Array) -> tuple[int, ...]:
    return tuple(x.sharding.shard_shape(x.shape))


def assert_tree_close(actual, expected, rtol: float, elementwise: bool = True, flips: int = 0) -> None:
    """Per leaf: same shape; ||a - b|| / ||b|| <= rtol; and elementwise |a - b| <= rtol * |b| + rtol * max|b|.

    The norm-wise bound is the claim; the elementwise bound catches a few badly wrong entries that a norm
    over a large leaf would hide. `elementwise=False` only for bf16 against fp32, where single entries carry
    the rounding of an 8-bit significand. `flips` (FP8 on both sides, `FP8_FLIPS`): the elementwise bound may miss
    at up to flips * (the leaf's largest dimension) entries, a row or column per FP8 rounding flip.
    """
    paths_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    paths_e, tree_e = jax.tree_util.tree_flatten_with_path(expected)
    assert jax.tree.structure(actual) == tree_e, "trees differ in structure"
    for (path, a), (_, e) in zip(paths_a, paths_e):
        name = jax.tree_util.keystr(path)
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
        assert np.all(np.isfinite(a)), f"{name}: non-finite values"
        scale = float(np.max(np.abs(e))) if e.size else 0.0
        assert scale > 0, f"{name}: reference is all zero, the comparison would assert nothing"
        rel = float(np.linalg.norm(a - e) / np.linalg.norm(e))
        assert rel <= rtol, f"{name}: norm-wise relative error {rel:.3g} > {rtol:g}"
        if elementwise and flips:
            bad = np.abs(a - e) > rtol * np.abs(e) + rtol * scale
            allowed = flips * max(a.shape, default=1)
            assert bad.sum() <= allowed, (
                f"{name}: {int(bad.sum())} entries outside the bound, > {allowed} ({flips} flips)"
            )
        elif elementwise:
            np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=name)


# Unit roundoff of fp32 (half an ulp of 1.0): one correctly rounded operation changes a value by at most this
# fraction of it.
U32 = 2.0**-24
# fp32 parity of a whole model across layouts. A layout changes only the order of fp32 sums (over rows, tokens,
# microbatches and the shards of a contraction); regrouping a sum of n terms changes it by at most
# (n - 1) * U32 * sum|terms| (Higham, Accuracy and Stability of Numerical Algorithms, 2002, section 4.2), an
# absolute error on the scale of the larger terms, hence the elementwise floor rtol * max|g| in
# `assert_tree_close`. Measured on data=8, data x fsdp x tensor (sequence parallel), pipeline p=2 and p=4,
# under XLA's default code generation, --xla_cpu_max_isa=AVX2 and SSE4_2: gradients at most 5.7e-7 norm-wise
# and 5.2e-7 elementwise, the loss 1.7e-7. 1e-5 leaves a factor of about 18 for other CPUs and compilers and
# still fails on a real error (a lost microbatch or a doubled gradient is >= 1e-2).
FP32_RTOL = 1e-5
# FP8 parity (FP8 GEMMs on both sides): the operands entering each quantiser differ between layouts by fp32
# reordering alone, so their FP8 copies are equal except where a value lies within that reordering (about 1e-7 of
# it) of a rounding boundary of the FP8 grid, whose steps are 2^-3 to 2^-4 of a value (E4M3) or 2^-2 to 2^-3
# (E5M2): there it rounds to the other neighbour on one side, a "flip" that moves one element by one FP8 step. The
# chance is about 2e-7 / 2^-4, 3e-6 per quantised element; the parity tests' 2-layer models quantise a few 1e5
# elements per step, so about one flip in a step is expected, spread over the 40 or so quantised tensors. A flipped
# element of an output gradient g changes one column of its weight gradient x^T g, a flipped input element one row:
# entries that miss the elementwise fp32 bound by far, while the norm-wise bound holds (measured: one flip seen, on
# an AMD EPYC, 2 entries of one 4096-entry leaf off, that leaf 2.0e-7 norm-wise). FP8_FLIPS such rows or columns
# are allowed per leaf (`assert_tree_close(flips=...)`); a layout that quantised differently everywhere (each
# shard's own amax) misses the norm-wise bound by 1e4 and every elementwise one.
FP8_FLIPS = 2


def _adam_constants(opt) -> dict:
    """AdamW's hyperparameters as the fp32 numbers the compiled step uses (0.9 is 0.89999998 in fp32), in
    float64 for the host-side arithmetic below."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    return {"b1": f32(opt.b1), "b2": f32(opt.b2), "eps": f32(opt.eps), "wd": f32(opt.weight_decay)}


def assert_adam_step_close(
    got: dict,
    want: dict,
    old_params,
    rtol: float,
    *,
    opt,
    lr: float,
    decayed,
    elementwise: bool = True,
    flips: int = 0,
) -> None:
    """One AdamW step from `old_params` (optimizer count 0 -> 1) in a layout under test against the reference.

    `got` and `want` hold "mu", "nu" (Adam's moments after the step) and "params" (after the step: the fp32
    master copy under the 16p layout), numpy trees; `opt` is the OptimizerConfig, `lr` the rate applied (the
    step's learning-rate metric), `decayed` the weight-decay mask (`jaxpar.training.optimizer.weight_decay_mask`).

    Every bound follows from what is compared:
      1. mu = (1 - b1) * g, the (clipped) gradient scaled exactly: `assert_tree_close` at `rtol`, the
         gradient's own tolerance. The gradients are the only thing a layout changes: reordered sums.
      2. nu = (1 - b2) * g^2: squaring doubles a relative error, so 2 * rtol.
      3. The update equals AdamW applied to the layout's own moments, recomputed here in float64: the step
         computes it in about 8 fp32 roundings of sizes |a| = |m_hat / (sqrt(v_hat) + eps)| and |wd * p|
         (bias corrections, sqrt, + eps, divide, weight decay, * lr), so |delta u| <= 8 * U32 * lr *
         (|a| + |wd * p|), plus one ulp of the stored parameter. This checks the optimizer, not the layout.
      4. The update against the reference's, through Adam's conditioning: at count 1, m_hat = g and
         sqrt(v_hat) = |g|, so u = -lr * (g / (|g| + eps) + wd * p), whose slope in g is
         lr * eps / (|g| + eps)^2: at most lr / eps near g = 0 (1e8 * lr with the default eps), so an entry
         whose gradient is within its tolerance of zero may move by up to that slope times the tolerance,
         while a gradient far from zero (|g| >> eps) pins the update. The bound per entry is the largest
         slope over the gradient's tolerance interval [|g| - tol, |g| + tol] (mean value theorem) times
         tol = rtol * (|g| + max|g|) (the tolerance of 1, elementwise), plus the roundings of 3 on both
         sides. With `elementwise=False` (bf16 against fp32) 1 and 2 are norm-wise and 4 is skipped: single
         bf16 entries carry 8-bit rounding, which no elementwise bound through lr / eps can hold.
    """
    assert_tree_close(got["mu"], want["mu"], rtol, elementwise, flips)
    assert_tree_close(got["nu"], want["nu"], 2 * rtol, elementwise, flips)
    c = _adam_constants(opt)
    leaves = zip(
        jax.tree_util.tree_flatten_with_path(got["params"])[0],
        jax.tree.leaves(want["params"]),
        jax.tree.leaves(old_params),
        jax.tree.leaves(got["mu"]),
        jax.tree.leaves(got["nu"]),
        jax.tree.leaves(want["mu"]),
        jax.tree.leaves(decayed),
    )
    for (path, new), ref_new, old, mu, nu, ref_mu, decay in leaves:
        name = jax.tree_util.keystr(path)
        new, ref_new, old = (np.asarray(x) for x in (new, ref_new, old))
        assert new.dtype == ref_new.dtype == old.dtype == np.float32 and new.shape == ref_new.shape == old.shape, name
        p = old.astype(np.float64)
        wd_p = c["wd"] * p if decay else np.zeros_like(p)
        # 3. AdamW on the layout's own moments, exactly (float64), at count 1.
        m_hat = np.asarray(mu, np.float64) / (1.0 - c["b1"])
        v_hat = np.asarray(nu, np.float64) / (1.0 - c["b2"])
        a = m_hat / (np.sqrt(v_hat) + c["eps"])
        expected = -lr * (a + wd_p)
        got_u = new.astype(np.float64) - p
        rounding = 8 * U32 * lr * (np.abs(a) + np.abs(wd_p)) + np.spacing(np.abs(new)).astype(np.float64)
        bad = np.abs(got_u - expected) > rounding
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} update entries are not AdamW of this layout's own "
            f"moments, e.g. {got_u[bad][:3]} vs {expected[bad][:3]}"
        )
        if not elementwise:
            continue
        # 4. Against the reference update, through Adam's slope over the gradient's tolerance interval.
        g = np.asarray(ref_mu, np.float64) / (1.0 - c["b1"])
        tol = rtol * (np.abs(g) + np.max(np.abs(g)))
        nearest = np.maximum(np.abs(g) - tol, 0.0)
        slope = lr * c["eps"] / (nearest + c["eps"]) ** 2
        ref_u = ref_new.astype(np.float64) - p
        bound = slope * tol + 2 * rounding
        bad = np.abs(got_u - ref_u) > bound
        assert bad.sum() <= flips * max(bad.shape, default=1), (
            f"{name}: {int(bad.sum())} update entries differ from the reference by more than "
            f"Adam's slope times the gradient tolerance, e.g. {got_u[bad][:3]} vs "
            f"{ref_u[bad][:3]} (bound {bound[bad][:3]})"
        )


def adam_step_args(plan: StepPlan, metrics: dict) -> dict:
    """The keyword arguments of `assert_adam_step_close` for a step of `plan` that reported `metrics`."""
    return {
        "opt": plan.cfg.optimizer,
        "lr": float(metrics["learning_rate"]),
        "decayed": weight_decay_mask(plan.logical, plan.cfg.optimizer.weight_decay_exclude),
    }


def mesh_devices(overrides: Sequence[str]) -> int:
    """The device count of the mesh that `overrides` set (each `mesh.<axis>=N`; an axis not named counts 1)."""
    n = 1
    for o in overrides:
        if o.startswith("mesh."):
            n *= int(o.split("=")[1])
    return n


def stepped(step, state: dict, batch: dict) -> dict:
    """Runs one compiled train `step` on `state` (consumed) and `batch`: host copies of "metrics", "params" and
    Adam's "mu" and "nu" after it."""
    new, metrics = step(state, batch)
    return {
        "metrics": to_host(metrics),
        "params": to_host(new["params"]),
        "mu": to_host(otu.tree_get(new["opt_state"], "mu")),
        "nu": to_host(otu.tree_get(new["opt_state"], "nu")),
    }


def assert_step_equals(plan: StepPlan, got: dict, ref: dict, rtol: float, flips: int = 0) -> None:
    """`got` (`stepped` of `plan`'s step) equals `ref` (`stepped` of the reference's step from the same state,
    whose host copy is `ref["host_state"]`): the token count exactly, loss and grad norm, and the Adam step
    (`assert_adam_step_close`) within `rtol`, with `flips` FP8 rounding flips allowed (`FP8_FLIPS`)."""
    metrics = got["metrics"]
    assert metrics["tokens"] == ref["metrics"]["tokens"]
    assert_scalar_close(metrics["loss"], ref["metrics"]["loss"], rtol, "loss")
    assert_scalar_close(metrics["grad_norm"], ref["metrics"]["grad_norm"], rtol, "grad_norm")
    assert_adam_step_close(got, ref, ref["host_state"]["params"], rtol, **adam_step_args(plan, metrics), flips=flips)


def assert_scalar_close(actual, expected, rtol: float, name: str) -> None:
    a, e = float(actual), float(expected)
    assert np.isfinite(a), f"{name}: {a}"
    assert abs(a - e) <= rtol * abs(e), f"{name}: {a!r} vs {e!r} (relative {abs(a - e) / abs(e):.3g} > {rtol:g})"
