"""Explicit tensor parallelism never moves more activation bytes than the compiler-chosen partitioning of the same
model (`jaxpar.analysis.bench.tensor_bytes`; the remat policies of `jaxpar.model.stack` save the tensor collectives'
outputs they need for that), while the gradients are still reduced in fp32.

On 8 simulated CPU devices (tiny shape, data=2 x tensor=4) in the default suite for remat dots, all four policies
in the slow one; compiled for 8 H100s without a GPU (configs/llama_1b.yaml shape, as issue 13 measured it) where
the gpu-compile extra is installed (skipped otherwise, with the library's reason).
"""

from __future__ import annotations

import os

import jax
import pytest

from jaxpar.analysis.bench.tensor_bytes import compile_steps, format_table, program_bytes
from jaxpar.config import load_config
from jaxpar.config.choices import REMAT_POLICIES
from jaxpar.config.validate import resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["train.global_batch_size=8", "train.grad_accum_steps=1", "optimizer.zero_stage=1"]
TENSOR4 = ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4"]
POLICIES = REMAT_POLICIES


_CPU_ROWS: dict = {}


def _cpu_row(remat: str, sp: bool) -> dict:
    """Both programs of the tiny shape on data=2 x tensor=4 (compiled once per session)."""
    if (remat, sp) not in _CPU_ROWS:
        overrides = [
            "model.n_kv_heads=4",
            *COMMON,
            *TENSOR4,
            f"tensor.sequence_parallel={str(sp).lower()}",
            f"model.remat={remat}",
        ]
        cfg = resolve_config(load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides, validate=False), 8)
        _CPU_ROWS[remat, sp] = {"layout": f"tensor=4 sp={sp}", "remat": remat, **compile_steps(cfg, jax.devices()[:8])}
    return _CPU_ROWS[remat, sp]


def _check(row: dict) -> None:
    e, c = row["explicit"], row["compiler"]
    assert e.activation_bytes > 0 and c.activation_bytes > 0, format_table([row])
    assert e.activation_bytes <= c.activation_bytes, format_table([row])
    assert e.gradient_dtypes == ("f32",), format_table([row])


def _check_cpu(remat: str, sp: bool) -> None:
    """On XLA:CPU the compiler-chosen program is weaker than on GPU (it all-reduces the q, k and v input
    gradients apart), so beyond `_check` the explicit step must move exactly what the policies promise
    (`jaxpar.model.stack`): what it moves without recomputation, except that names and full under sequence
    parallelism re-gather the 2 block inputs of each layer in the backward."""
    row, none = _cpu_row(remat, sp), _cpu_row("none", sp)
    _check(row)
    table = format_table([none, row])
    got, want = row["explicit"].activation_by_kind, none["explicit"].activation_by_kind
    if sp and remat in ("names", "full"):
        layers = 4  # configs/tiny.yaml
        assert {k: v for k, v in got.items() if k != "all-gather"} == {
            k: v for k, v in want.items() if k != "all-gather"
        }, table
        assert got["all-gather"]["count"] == want["all-gather"]["count"] + 2 * layers, table
    else:
        assert got == want, table


@pytest.mark.slow  # two compiles of about 12 s each per case (CI's slow suite runs it)
@pytest.mark.parametrize("sp", [False, True])
def test_remat_dots_moves_no_more_than_the_compiler_on_cpu(devices8, sp):
    """The case issue 13 measured (1.24x without, 1.36x with sequence parallelism on the GPU target, before the
    policy saved the collectives' outputs): the backward re-runs neither the attention exit nor the enters."""
    _check_cpu("dots", sp)


@pytest.mark.slow
@pytest.mark.parametrize("remat", POLICIES)
@pytest.mark.parametrize("sp", [False, True])
def test_every_policy_moves_no_more_than_the_compiler_on_cpu(devices8, remat, sp):
    _check_cpu(remat, sp)


def test_program_bytes_sorts_tensor_collectives_from_gradient_reductions(devices8):
    """Over `tensor` alone: activation bytes (with loop trip counts); over data: the gradient-reduction dtype."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))

    def body(x, g):
        def layer(c, _):
            return jax.lax.psum(c, "tensor"), None

        x, _ = jax.lax.scan(layer, x, None, length=3)
        return x, jax.lax.psum(g, "data")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False))
    x = jax.ShapeDtypeStruct((16, 32), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((64,), jnp.float32)
    got = program_bytes(f.lower(x, g).compile().as_text(), mesh)
    assert got.activation_by_kind["all-reduce"]["count"] == 3
    # 3 all-reduces of 16*32 bf16 values over 4 devices (XLA:CPU may widen bf16 to fp32: either width).
    assert got.activation_bytes in (3 * 2 * 3 / 4 * 16 * 32 * 2, 3 * 2 * 3 / 4 * 16 * 32 * 4)
    assert got.gradient_dtypes == ("f32",)
    assert got.total_bytes == pytest.approx(got.activation_bytes + 2 * 1 / 2 * 64 * 4)


@pytest.mark.slow
@pytest.mark.requires_gpu_compile
@pytest.mark.parametrize("remat", POLICIES)
@pytest.mark.parametrize("sp", [False, True])
def test_llama_1b_on_8_h100s_moves_no_more_than_the_compiler(remat, sp):
    """data=2 x tensor=4, ZeRO-1, bf16, 8 x 4096 tokens: explicit activation bytes <= the compiler-chosen
    program's, gradients reduced in fp32 where the compiler-chosen program reduces them in bf16."""
    from jaxpar.analysis.gpu.deviceless import compile_devices
    from jaxpar.analysis.gpu.targets import cluster

    clu = cluster("h100", 1, 8)
    overrides = [*COMMON, *TENSOR4, f"tensor.sequence_parallel={str(sp).lower()}", f"model.remat={remat}"]
    cfg = resolve_config(load_config(os.path.join(ROOT, "configs", "llama_1b.yaml"), overrides, validate=False), 8)
    row = {"layout": f"tensor=4 sp={sp}", "remat": remat, **compile_steps(cfg, compile_devices(clu))}
    _check(row)
    assert "bf16" in row["compiler"].gradient_dtypes, format_table([row])
