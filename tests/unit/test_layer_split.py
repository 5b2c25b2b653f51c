"""The uneven pipeline split's layout (`jaxpar.parallel.layer_split.StageLayout`) and its config keys
(pipeline.stage_layers, pipeline.balance_stages).

Pure numpy (and one abstract trace): the moves between the storage layout (L_s/p rows per device in model order, L_s = L
rounded up to a multiple of p) and the stage layout are replayed on row numbers, both ways, for the interleaved ring and
zb-v's V. The jax side of the moves runs in tests/parity/test_pipeline_uneven.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from step_helpers import CONFIG, TINY, make_plan

from jaxpar.config import ConfigError, load_config
from jaxpar.parallel import layer_split
from jaxpar.parallel.layer_split import StageLayout
from jaxpar.parallel.zero_bubble import v_shape
from jaxpar.training import pipelined
from jaxpar.training.state import abstract_state


def _storage(layout: StageLayout) -> np.ndarray:
    """The model row each storage row holds, [p, L_s/p], -1 for the storage padding after the last layer."""
    rows = np.arange(layout.stored)
    return np.where(rows < layout.rows, rows, -1).reshape(layout.p, -1)


def _replay(layout: StageLayout) -> tuple[np.ndarray, np.ndarray]:
    """(the stage layout's rows [p, v*n_max] as the moves fill them, -1 for padding; the storage rows [p, L_s/p]
    as the inverse moves fill them back from it, -1 where none comes back), on model row numbers."""
    storage = _storage(layout)
    local, local_back, rounds = layout.moves
    stage = np.where(local >= 0, np.take_along_axis(storage, np.maximum(local, 0), axis=1), -1)
    for moves in rounds:
        assert len({m[0] for m in moves}) == len(moves) and len({m[2] for m in moves}) == len(moves)
        for src, row, dst, q in moves:
            assert src != dst and stage[dst, q] == -1
            stage[dst, q] = storage[src, row]
    back = np.where(local_back >= 0, np.take_along_axis(stage, np.maximum(local_back, 0), axis=1), -1)
    for moves in rounds:
        for src, row, dst, q in moves:
            back[src, row] = stage[dst, q]
    return stage, back


@pytest.mark.parametrize(
    "counts,p,placement",
    [
        ((8, 9, 9, 6), 4, None),  # llama3_8b's balanced split
        ((3, 2, 2, 1), 2, None),  # interleaved ring, v = 2
        ((3, 1, 2, 2), 2, v_shape(2)),  # zb-v
        ((1, 3, 3, 3, 2, 2, 1, 1), 4, v_shape(4)),
        ((4, 0), 2, None),  # a chunk without layers: all padding
        ((2, 3, 2), 3, None),  # 7 layers over 3 stages: stored as 9 rows, the last 2 never run
        ((3,) * 6 + (4,) * 10, 16, None),  # DeepSeek-V3's 58 MoE blocks over 16 stages, stored as 64 rows
    ],
)
def test_moves_place_every_row_and_return_it(counts, p, placement):
    placement = placement or tuple(c % p for c in range(len(counts)))
    layout = StageLayout(counts, p, placement)
    stage, back = _replay(layout)
    np.testing.assert_array_equal(back, _storage(layout))
    mask = layout.mask()
    assert mask.shape == (p, layout.v * layout.n_max)
    np.testing.assert_array_equal(mask, (stage >= 0).astype(np.float32))
    starts = np.concatenate([[0], np.cumsum(counts)])
    for d in range(p):  # the device's chunks in model order, each in its slot, padding after
        chunks = [c for c in range(len(counts)) if placement[c] == d]
        for j, c in enumerate(chunks):
            slot = stage[d, j * layout.n_max : (j + 1) * layout.n_max]
            np.testing.assert_array_equal(slot[: counts[c]], np.arange(starts[c], starts[c + 1]))
            assert np.all(slot[counts[c] :] == -1)
    assert layout.device_rows() == [int(np.sum(stage[d] >= 0)) for d in range(p)]


def test_moves_are_few_for_a_near_even_split():
    """(8, 9, 9, 6) over 8-row storage: 3 rows change device, in 2 rounds (device 3 sends two)."""
    _, _, rounds = StageLayout((8, 9, 9, 6), 4, (0, 1, 2, 3)).moves
    assert sum(len(r) for r in rounds) == 3 and len(rounds) == 2


@pytest.mark.parametrize(
    "counts,p,placement,match",
    [
        ((3, 2, 2), 2, (0, 1, 0), "p\\*v counts"),
        ((3, -1), 2, (0, 1), "p\\*v counts"),
        ((2, 2, 2, 2), 2, (0, 0, 0, 1), "placement"),
    ],
)
def test_layout_refuses(counts, p, placement, match):
    with pytest.raises(ValueError, match=match):
        StageLayout(counts, p, placement)


PIPE = ("model.n_layers=8", "mesh.data=1", "mesh.fsdp=1", "mesh.pipeline=2", "pipeline.microbatches=2")


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ("pipeline.stage_layers=[5,2]",),
            r"\[5, 2\] must be counts .* adding up to model.n_layers=8 \(they add up to 7\)",
        ),
        (
            ("pipeline.stage_layers=[4,2,2]",),
            r"3 entries; it needs one per model chunk, mesh.pipeline=2 = 2 .*\[4, 4\]",
        ),
        (("pipeline.stage_layers=[5,3]", "pipeline.balance_stages=true"), "both choose the split; set one"),
        (("mesh.pipeline=1", "pipeline.balance_stages=true"), "needs mesh.pipeline > 1"),
        (
            ("model.moe.num_experts=4", "model.moe.every=2", "pipeline.stage_layers=[5,3]"),
            "each a multiple of model.moe.every=2",
        ),
    ],
)
def test_config_errors(overrides, match):
    """Wrong counts are refused at the config check, naming the rule and the even split."""
    devices = 1 if "mesh.pipeline=1" in overrides else 2
    with pytest.raises(ConfigError, match=match):
        load_config(CONFIG, [*TINY, *PIPE, *overrides], num_devices=devices)


def test_uneven_counts_relax_the_chunk_depth_rule():
    """With stage_layers, interleaving needs n_layers divisible by p (storage), not by p*v."""
    cfg = load_config(
        CONFIG,
        [*TINY, *PIPE, "model.n_layers=6", "pipeline.virtual_stages=2", "pipeline.stage_layers=[2,2,1,1]"],
        num_devices=2,
    )
    assert cfg.pipeline.stage_layers == (2, 2, 1, 1)


def test_a_model_that_ignores_the_padding_is_refused(monkeypatch):
    """A model whose run_blocks does not run its stack through `scan_layers` would run the stage layout's padding
    rows as layers: the blocks refuse, naming the model and the fix (checked on abstract values, no compile)."""
    plan = make_plan([*PIPE[1:], "model.n_layers=4", "pipeline.stage_layers=[3,1]"], jax.devices()[:2])
    monkeypatch.setattr(pipelined, "run_blocks", lambda model, x, *args, **kw: x)  # no scan_layers
    params = abstract_state(plan)["params"]
    parts = pipelined.stage_parts(plan, params, plan.loss_fn)
    layers = {**params["blocks"], layer_split.ACTIVE: jax.ShapeDtypeStruct((3,), jnp.float32)}
    x = jax.ShapeDtypeStruct((1, 8, 64), jnp.float32)
    with pytest.raises(ValueError, match="model 'llama'.s run_blocks does not: run it with the even split"):
        jax.eval_shape(lambda lay, y: parts.blocks(lay, y, {}), layers, x)
