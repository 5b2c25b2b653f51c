"""One train step with tensor parallelism equals the single-device step; tensor-parallel configs fail at load.

Meshes on simulated CPU devices: tensor=2, tensor=4, fsdp=2 x tensor=2 and data=2 x fsdp=2 x tensor=2, each with
and without sequence parallelism (`tensor.sequence_parallel`), at ZeRO stage 1 or 3. Compared in fp32 at 1e-5
relative against a single-device step of the same model: loss, grad norm, the gradients of `make_grad_fn`,
Adam's moments, the updated parameters and the update itself (`step_helpers.assert_adam_step_close`). Clipping is
active on the tensor=4 mesh. Adam runs with its default eps, without warmup. Grouped-query attention needs a key/value
head per tensor rank, so the t = 2 meshes run n_heads = 4, n_kv_heads = 2 and the t = 4 mesh n_kv_heads = 4.

Each test first asserts that its layout differs from the reference's: attention heads and the vocabulary are
split over `tensor` (the local `wq` shard holds H/t heads), and the grad fn's lowered HLO holds tensor-group
collectives of the kind its mode needs: all-gathers and reduce-scatters with sequence parallelism, only
all-reduces without. (A light check; golden collective counts are another test's job.)

Shape letters: G global batch, T sequence length, L layers, D model width, H query heads, K head width,
V vocabulary, t tensor size.
"""

import re

import jax
import numpy as np
import pytest
from optax import tree_utils as otu
from step_helpers import (
    CONFIG,
    FAST_COMPILE,
    FIRST_STEP_AT_PEAK,
    FP32,
    FP32_RTOL,
    TINY,
    VOCAB,
    adam_step_args,
    assert_adam_step_close,
    assert_scalar_close,
    assert_tree_close,
    device_batch,
    host_batch,
    make_plan,
    shard_shape,
    to_host,
)

from jaxpar.config import ConfigError, load_config
from jaxpar.parallel.tensor import TensorParallel
from jaxpar.training.state import init_state
from jaxpar.training.step import make_grad_fn, make_train_step

pytestmark = pytest.mark.usefixtures("fast_compile")  # tests/conftest.py

RTOL = FP32_RTOL  # fp32 whole-model parity: reordered sums (step_helpers.FP32_RTOL says why)
SEED = 5
T = 8  # divisible by every tensor size here (sequence parallelism splits it)
VALID = (8, 3, 8, 0, 5, 8, 1, 6)  # uneven valid-token counts per row, one row fully masked
G = len(VALID)
CLIP_NORM = 0.05  # well below this model's initial gradient norm (~1.5)
MESHES = {  # (data, fsdp, tensor)
    "tensor2": (1, 1, 2),
    "tensor4": (1, 1, 4),
    "fsdp2_tensor2": (1, 2, 2),
    "data2_fsdp2_tensor2": (2, 2, 2),
}
CLIPPED_MESHES = ("tensor4",)
# (mesh, sequence parallel, ZeRO stage): every mesh and mode once; stages 1 and 3 alternate, so that each
# fsdp/data mesh runs both. The default suite runs every mesh with sequence parallelism and one without
# (SLOW_CASES run under -m slow).
CASES = [
    ("tensor2", True, 1),
    ("tensor2", False, 3),
    ("tensor4", True, 3),
    ("tensor4", False, 1),
    ("fsdp2_tensor2", True, 3),
    ("fsdp2_tensor2", False, 1),
    ("data2_fsdp2_tensor2", True, 1),
    ("data2_fsdp2_tensor2", False, 3),
]
SLOW_CASES = {("tensor2", False, 3), ("tensor4", False, 1), ("data2_fsdp2_tensor2", False, 3)}


def _kv_heads(tensor: int) -> int:
    return 4 if tensor == 4 else 2


def _overrides(data: int, fsdp: int, tensor: int, sp: bool, zero: int, clipped: bool) -> list[str]:
    clip = CLIP_NORM if clipped else 0
    return [
        *FP32,
        *FIRST_STEP_AT_PEAK,
        f"optimizer.grad_clip_norm={clip}",
        f"optimizer.zero_stage={zero}",
        f"model.n_kv_heads={_kv_heads(tensor)}",
        f"mesh.data={data}",
        f"mesh.fsdp={fsdp}",
        f"mesh.tensor={tensor}",
        f"tensor.sequence_parallel={str(sp).lower()}",
        f"train.global_batch_size={G}",
    ]


def _wq(tree):
    return tree["blocks"]["attn"]["wq"]  # [L, D, H, K]: D over fsdp (and data at ZeRO-3), H over tensor


def _collective_groups(hlo_text: str) -> dict[str, set[str]]:
    """{collective: set of its replica groups as written, e.g. "[[0, 1], [2, 3]]"} from lowered StableHLO."""
    out = {}
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        lines = [line for line in hlo_text.splitlines() if f"stablehlo.{op}" in line]
        out[op] = set(re.findall(r"replica_groups = dense<(\[\[.*?\]\])>", "\n".join(lines)))
    return out


def _one_step(plan, state, batch) -> dict:
    """Gradients (make_grad_fn, and its lowered HLO text) then one train step; host copies. Consumes `state`."""
    lowered = jax.jit(make_grad_fn(plan)).lower(state["params"], batch)
    grad_fn = lowered.compile(compiler_options=FAST_COMPILE)
    step = make_train_step(plan).lower(state, batch).compile(compiler_options=FAST_COMPILE)
    grads, loss, n_tokens = grad_fn(state["params"], batch)
    out = {
        "grads": to_host(grads),
        "grad_loss": float(loss),
        "grad_tokens": float(n_tokens),
        "grads_sharding": _wq(grads).sharding,
        "params0": to_host(state["params"]),
        "hlo": lowered.as_text(),
    }
    new, metrics = step(state, batch)
    out.update(
        metrics=to_host(metrics),
        params=to_host(new["params"]),
        mu=to_host(otu.tree_get(new["opt_state"], "mu")),
        nu=to_host(otu.tree_get(new["opt_state"], "nu")),
    )
    return out


@pytest.fixture(scope="module")
def reference():
    """Single-device results and initial state per (n_kv_heads, clipping), computed once each."""
    cache = {}

    def get(n_kv_heads: int, clipped: bool) -> dict:
        key = (n_kv_heads, clipped)
        if key not in cache:
            overrides = _overrides(1, 1, 1, False, 0, clipped)
            plan = make_plan([*overrides, f"model.n_kv_heads={n_kv_heads}"], jax.devices()[:1])
            state = init_state(plan, SEED)
            host_state = to_host(state)
            batch = device_batch(plan, host_batch(VALID, T, SEED))
            cache[key] = dict(_one_step(plan, state, batch), host_state=host_state)
        return cache[key]

    return get


@pytest.mark.parametrize(
    "mesh_name,sp,zero",
    [
        pytest.param(
            *c, id=f"{c[0]}-{'sp' if c[1] else 'nosp'}-zero{c[2]}", marks=[pytest.mark.slow] * (c in SLOW_CASES)
        )
        for c in CASES
    ],
)
def test_one_step_equals_single_device(mesh_name, sp, zero, reference, need_devices):
    data, fsdp, tensor = MESHES[mesh_name]
    n = data * fsdp * tensor
    need_devices(n)
    clipped = mesh_name in CLIPPED_MESHES
    ref = reference(_kv_heads(tensor), clipped)
    plan = make_plan(_overrides(data, fsdp, tensor, sp, zero, clipped), jax.devices()[:n])

    # The layout under test; the initial parameters are the reference's (identical for every layout,
    # tests/parity/test_init.py), placed onto this layout's shardings.
    state = jax.device_put(ref["host_state"], plan.state_shardings)
    batch = device_batch(plan, host_batch(VALID, T, SEED))
    assert dict(plan.mesh.shape) == {"data": data, "pipeline": 1, "fsdp": fsdp, "context": 1, "tensor": tensor}
    assert plan.tensor_parallel == TensorParallel(size=tensor, sequence_parallel=sp)
    wq, table = _wq(state["params"]), state["params"]["embed"]["table"]
    L, D, H, K = wq.shape
    params_over = fsdp * (data if zero == 3 else 1)
    assert wq.sharding.spec[2] == "tensor" and table.sharding.spec[0] == "tensor"
    assert shard_shape(wq) == (L, D // params_over, H // tensor, K)  # the reference holds all H heads
    assert shard_shape(table) == (VOCAB // tensor, D // params_over)
    assert shard_shape(batch["inputs"]) == (G // (data * fsdp), T)  # whole sequences: SP splits activations

    out = _one_step(plan, state, batch)
    grads_over = fsdp * (data if zero >= 2 else 1)
    assert tuple(out["grads_sharding"].shard_shape(wq.shape)) == (L, D // grads_over, H // tensor, K)
    # Collectives over the tensor groups (tensor is the innermost mesh axis: consecutive device indices).
    tensor_groups = str(np.arange(n).reshape(-1, tensor).tolist())
    groups = _collective_groups(out["hlo"])
    assert tensor_groups in groups["all_reduce"]  # the vocab-parallel cross-entropy's sums, in both modes
    if sp:  # all-gather over T before each column-parallel op, reduce-scatter after each row-parallel op
        assert tensor_groups in groups["all_gather"] and tensor_groups in groups["reduce_scatter"]
    else:  # Megatron f and g: all-reduces only
        assert tensor_groups not in groups["all_gather"] | groups["reduce_scatter"]

    m, ref_m = out["metrics"], ref["metrics"]
    assert m["tokens"] == ref_m["tokens"] == out["grad_tokens"] == sum(VALID)
    assert m["learning_rate"] == ref_m["learning_rate"] > 0
    assert_scalar_close(m["loss"], ref_m["loss"], RTOL, "loss")
    assert_scalar_close(out["grad_loss"], ref_m["loss"], RTOL, "grad_fn loss")
    assert_scalar_close(m["grad_norm"], ref_m["grad_norm"], RTOL, "grad_norm")
    if clipped:
        assert ref_m["grad_norm"] > 2 * CLIP_NORM and m["grad_norm"] > 2 * CLIP_NORM
    assert_tree_close(out["grads"], ref["grads"], RTOL)
    assert_adam_step_close(out, ref, out["params0"], RTOL, **adam_step_args(plan, m))


# --- tensor-parallel configs that cannot run fail at load, naming the key and the fix ---


def _load(tensor: int, *overrides: str):
    """tiny.yaml + TINY on a mesh of `tensor` devices, all on the tensor axis."""
    return load_config(
        CONFIG, [*TINY, "mesh.data=1", "mesh.fsdp=1", f"mesh.tensor={tensor}", *overrides], num_devices=tensor
    )


def test_config_rejects_kv_heads_not_divisible_by_tensor():
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads=2 must be divisible by mesh\.tensor=4"):
        _load(4, "model.n_kv_heads=2")
    _load(4, "model.n_kv_heads=4")  # one key/value head per rank loads


def test_config_rejects_vocab_not_divisible_by_tensor():
    with pytest.raises(ConfigError, match=r"model\.vocab_size=265 .*mesh\.tensor=2.*model\.vocab_size=266"):
        _load(2, "model.vocab_size=265")
    with pytest.raises(ConfigError, match=r"model\.vocab_size=270 .*mesh\.tensor=4.*model\.vocab_size=272"):
        _load(4, "model.n_kv_heads=4", "model.vocab_size=270")


def test_config_rejects_seq_len_not_divisible_with_sequence_parallel():
    for sp in ("tensor.sequence_parallel=true", "tensor.sequence_parallel=null"):  # null: on when tensor > 1
        with pytest.raises(ConfigError, match=r"data\.seq_len=6 must be divisible by mesh\.tensor=4"):
            _load(4, "model.n_kv_heads=4", "data.seq_len=6", sp)
    # Without sequence parallelism every rank holds the whole sequence: any length loads.
    cfg = _load(4, "model.n_kv_heads=4", "data.seq_len=6", "tensor.sequence_parallel=false")
    assert cfg.data.seq_len == 6 and cfg.tensor.sequence_parallel is False
