"""Expert parallelism's all-to-all bytes: the compiled train step's all-to-alls (parsed from its HLO,
`jaxpar.analysis.hlo.collectives`) against the analytic count `jaxpar.parallel.expert.all_to_all_bytes`, per device and
step.

Tiny MoE model (step_helpers.TINY, two blocks as one MoE group of E = 8 experts, top-2), data=2 x fsdp=2 x
tensor=2 with the experts over data x fsdp (ep = 4), two accumulation microbatches. The issue's bound is
HLO / formula <= 1.02; the formula counts every buffer the step sends, so the ratio is 1 up to float rounding.
Every all-to-all runs over the expert axes and nothing else.
"""

import jax
import jax.numpy as jnp
import pytest
from step_helpers import FP32, make_plan

from jaxpar.analysis.hlo.collectives import collectives_by_axis
from jaxpar.parallel.expert import all_to_all_bytes
from jaxpar.training.state import abstract_state
from jaxpar.training.step import make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

G, T, E, K, ACCUM = 16, 8, 8, 2, 2


@pytest.mark.parametrize(
    "routing,remat",
    [
        ("dropless", "none"),
        pytest.param("capacity", "none", marks=pytest.mark.slow),
        pytest.param("dropless", "full", marks=pytest.mark.slow),
        pytest.param("capacity", "full", marks=pytest.mark.slow),
    ],
)
def test_all_to_all_bytes_equal_the_formula(routing, remat, devices8):
    overrides = [
        *FP32,
        f"model.moe.num_experts={E}",
        f"model.moe.top_k={K}",
        "model.moe.every=2",
        f"model.moe.routing={routing}",
        "model.moe.expert_axes=[data,fsdp]",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        f"train.global_batch_size={G}",
        f"train.grad_accum_steps={ACCUM}",
        f"model.remat={remat}",
    ]
    plan = make_plan(overrides, devices8)
    batch = {
        k: jax.ShapeDtypeStruct((G, T), jnp.float32 if k == "loss_mask" else jnp.int32, sharding=plan.batch_sharding)
        for k in ("inputs", "targets", "loss_mask")
    }
    hlo = make_train_step(plan).lower(abstract_state(plan), batch).compile().as_text()
    a2a = {axes: v for (axes, kind), v in collectives_by_axis(hlo, plan.mesh).items() if kind == "all-to-all"}
    assert set(a2a) == {("data", "fsdp")}  # over the expert axes only

    cfg = plan.cfg
    rows = G // (2 * 2) // ACCUM  # local rows of one microbatch
    units = cfg.model.n_layers // cfg.model.moe.every
    per_block = all_to_all_bytes(routing, 4, rows, T, K, E, cfg.model.d_model, 4, cfg.model.moe.capacity_factor, remat)
    formula = per_block * units * ACCUM
    ratio = a2a[("data", "fsdp")]["bytes"] / formula
    print(
        f"{routing} remat={remat}: HLO {a2a[('data', 'fsdp')]['bytes']:,.0f} B, formula {formula:,.0f} B, {ratio:.4f}"
    )
    assert abs(ratio - 1) <= 0.02
