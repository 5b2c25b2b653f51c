"""Shared pieces of the train-step tests: a tiny model config, meshes, batches, compilation and comparison.

Shape letters: G global batch (sequences), T sequence length, L layers, D model width, F mlp hidden width.
"""
from __future__ import annotations

import contextlib
import os
from typing import Sequence

import jax
import numpy as np

from jaxpar.config import load_config
from jaxpar.mesh import build_mesh
from jaxpar.train.step import BATCH_KEYS, StepPlan, build_plan

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "configs", "tiny.yaml")
# Compile time (not the model) dominates these tests, so the model is as small as the checks allow:
# d_model = 64 divides by 8 for every state sharding, vocab 264 is the byte tokenizer's minimum.
TINY = ("mesh.tensor=1", "model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.d_ff=128", "data.seq_len=8")
# Adam's first step maps g to about g / (|g| + eps): with the default eps = 1e-8, fp32 rounding noise in
# near-zero gradient entries becomes an update of a sizable fraction of the learning rate, so two correct
# layouts disagree there. eps = 1e-3 keeps the update a well-conditioned function of the gradient.
# No warmup: the default schedule starts at learning rate 0, which would make every update trivially equal.
WELL_CONDITIONED_ADAM = ("optimizer.eps=1.0e-3", "optimizer.warmup_steps=0")
FP32 = ("precision.compute_dtype=float32", "precision.layout=fp32")
VOCAB = 264


def make_plan(overrides: Sequence[str], devices: Sequence[jax.Device]) -> StepPlan:
    """The step plan of tiny.yaml + TINY + `overrides` on a mesh over `devices`."""
    cfg = load_config(CONFIG, [*TINY, *overrides], num_devices=len(devices))
    return build_plan(cfg, build_mesh(cfg, devices))


def host_batch(valid_per_row: Sequence[int], seq_len: int, seed: int) -> dict:
    """Random token batch of len(valid_per_row) rows; row i has its first valid_per_row[i] tokens valid."""
    rng = np.random.default_rng(seed)
    g = len(valid_per_row)
    mask = (np.arange(seq_len)[None, :] < np.asarray(valid_per_row)[:, None]).astype(np.float32)
    return {"inputs": rng.integers(0, VOCAB, (g, seq_len), dtype=np.int32),
            "targets": rng.integers(0, VOCAB, (g, seq_len), dtype=np.int32),
            "loss_mask": mask}


def device_batch(plan: StepPlan, batch: dict) -> dict:
    """Puts a host batch on the plan's mesh, rows split over data x fsdp."""
    return {k: jax.device_put(batch[k], plan.batch_sharding) for k in BATCH_KEYS}


def to_host(tree):
    """A numpy copy of a tree of arrays (take it before a donating step consumes the arrays)."""
    return jax.tree.map(lambda x: np.array(x), tree)


# Compile options that cut XLA:CPU compile time of a step 3-4x (compile time, not the model, dominates these
# tests): the legacy elemental emitters instead of the MLIR fusion emitters, and no LLVM optimisation. HLO
# passes (SPMD partitioning, collectives, fusion decisions) still run, so the program compared is the program
# shipped; only its machine code is less optimised. Both sides of every comparison compile this way.
FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True}


def compile_fast(jitted, *args):
    """Ahead-of-time compiles `jitted` (a `jax.jit` object) for `args` with `FAST_COMPILE`. The compiled
    executable keeps the jit's shardings and donation."""
    return jitted.lower(*args).compile(compiler_options=FAST_COMPILE)


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


def assert_tree_close(actual, expected, rtol: float, elementwise: bool = True) -> None:
    """Per leaf: same shape; ||a - b|| / ||b|| <= rtol; and elementwise |a - b| <= rtol * |b| + rtol * max|b|.

    The norm-wise bound is the claim; the elementwise bound catches a few badly wrong entries that a norm
    over a large leaf would hide. `elementwise=False` only for bf16 against fp32, where single entries carry
    the rounding of an 8-bit significand.
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
        if elementwise:
            np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=name)


def assert_update_close(new, expected_new, old, rtol: float, elementwise: bool = True) -> None:
    """The optimizer update `new - old` against `expected_new - old`, as `assert_tree_close` would compare
    it, except that elementwise each entry may also differ by one unit in the last place of the parameter.

    Both sides store `old + update` in fp32, so an update that agrees to 1e-7 can still round to parameters
    one ulp apart, and one ulp of a parameter (|p| ~ 0.02: 2e-9) exceeds rtol * max|update| for leaves with
    small updates. The norm-wise bound stays as strict as `assert_tree_close`'s; `elementwise` as there.
    """
    for (path, n), e, o in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(expected_new),
                               jax.tree.leaves(old)):
        name = jax.tree_util.keystr(path)
        n, e, o = np.asarray(n), np.asarray(e), np.asarray(o)
        assert n.dtype == e.dtype == o.dtype and n.shape == e.shape == o.shape, name
        got, want = n.astype(np.float64) - o, e.astype(np.float64) - o
        scale = float(np.max(np.abs(want)))
        assert scale > 0, f"{name}: the expected update is zero, the comparison would assert nothing"
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert rel <= rtol, f"{name}: update norm-wise relative error {rel:.3g} > {rtol:g}"
        if not elementwise:
            continue
        ulp = np.spacing(np.maximum(np.abs(n), np.abs(e))).astype(np.float64)
        bad = np.abs(got - want) > rtol * np.abs(want) + rtol * scale + ulp
        assert not bad.any(), (f"{name}: {int(bad.sum())} update entries differ by more than "
                               f"rtol * (|u| + max|u|) + 1 ulp, e.g. {got[bad][:3]} vs {want[bad][:3]}")


def assert_scalar_close(actual, expected, rtol: float, name: str) -> None:
    a, e = float(actual), float(expected)
    assert np.isfinite(a), f"{name}: {a}"
    assert abs(a - e) <= rtol * abs(e), f"{name}: {a!r} vs {e!r} (relative {abs(a - e) / abs(e):.3g} > {rtol:g})"
