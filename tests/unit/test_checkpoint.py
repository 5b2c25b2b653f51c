"""Checkpointer on 8 simulated CPU devices: round trip, resharding, retention, completeness, mismatches, async."""

import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.checkpoint.mismatch import EMPTY, ArrayDifference, CheckpointMismatchError
from jaxpar.checkpoint.store import Checkpointer, resolve_checkpoint_path, restore_from_path


@pytest.fixture(scope="module")
def mesh(need_devices):
    need_devices(8)
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _state(mesh, seed=0):
    """params sharded (data, fsdp) and (fsdp,), adam state over them, scalar int32 step."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w_DF": jax.device_put(jax.random.normal(k1, (8, 16)), NamedSharding(mesh, P("data", "fsdp"))),
        "b_F": jax.device_put(jax.random.normal(k2, (16,)), NamedSharding(mesh, P("fsdp"))),
    }
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    _, opt_state = opt.update(params, opt_state, params)  # non-zero mu/nu
    step = jax.device_put(jnp.array(7 + seed, jnp.int32), NamedSharding(mesh, P()))
    return {"params": params, "opt_state": opt_state, "step": step}


def _abstract(state, sharding_fn):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x)), state)


def _assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_same_and_different_sharding(tmp_path, mesh):
    state = _state(mesh)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=2, async_save=False)
    assert ckpt.save(1, state, data_state={"next_sample": 123}, config={"model": {"d_model": 8}, "lr": 1e-3})

    same = _abstract(state, lambda x: x.sharding)
    restored, data, config = ckpt.restore(1, same)
    _assert_bitwise_equal(restored, state)
    assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
    assert data == {"next_sample": 123} and config == {"model": {"d_model": 8}, "lr": 1e-3}
    for r, a in zip(jax.tree.leaves(restored), jax.tree.leaves(same)):
        assert r.sharding == a.sharding

    # Different layouts: fully replicated, and the matrix sharded over the transposed axes.
    for fn in (
        lambda x: NamedSharding(mesh, P()),
        lambda x: NamedSharding(mesh, P("fsdp", "data") if x.ndim == 2 else P()),
    ):
        target = _abstract(state, fn)
        assert any(t.sharding != s.sharding for t, s in zip(jax.tree.leaves(target), jax.tree.leaves(state)))
        resharded, _, _ = ckpt.restore(None, target)
        _assert_bitwise_equal(resharded, state)
        for r, a in zip(jax.tree.leaves(resharded), jax.tree.leaves(target)):
            assert r.sharding == a.sharding
    ckpt.close()


def test_layer_stack_rows_restore_cut_or_zero_padded(tmp_path, mesh):
    """A layer stack (`blocks`) stored with zero rows after its last layer for one pipeline (5 layers over 2
    stages: 6 rows) restores onto another stage count's rows: cut (5, one stage) or zero-padded (8, four), its
    Adam moments alike; any other leaf whose leading dimension differs is still refused."""
    rows = np.concatenate([np.random.default_rng(0).normal(size=(5, 4)), np.zeros((1, 4))]).astype(np.float32)
    params = {"blocks": {"w": jax.device_put(rows, NamedSharding(mesh, P("data")))}, "b_F": jnp.ones((16,))}
    state = {"params": params, "opt_state": optax.adam(1e-3).init(params)}
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False)
    ckpt.save(1, state, data_state={}, config={})
    for n, spec in ((5, P()), (8, P("fsdp"))):

        def target(path, x, n=n, spec=spec):
            stacked = any(getattr(k, "key", None) == "blocks" for k in path)
            shape = (n, *x.shape[1:]) if stacked else x.shape
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, spec if stacked else P()))

        restored, _, _ = ckpt.restore(1, jax.tree_util.tree_map_with_path(target, state))
        got = np.asarray(restored["params"]["blocks"]["w"])
        assert got.shape == (n, 4)
        np.testing.assert_array_equal(got[:5], rows[:5])
        assert not np.any(got[5:])
        assert restored["opt_state"][0].mu["blocks"]["w"].shape == (n, 4)
    wrong = _abstract(state, lambda x: NamedSharding(mesh, P()))
    wrong["params"]["b_F"] = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=r"params\.b_F: checkpoint shape \(16,\) != target shape \(8,\)"):
        ckpt.restore(1, wrong)
    ckpt.close()


def test_keep_last_n_and_should_save(tmp_path, mesh):
    state = _state(mesh)
    ckpt = Checkpointer(str(tmp_path), every_steps=2, keep=2, async_save=False)
    assert [s for s in range(7) if ckpt.should_save(s)] == [0, 2, 4, 6]
    assert not ckpt.save(3, state, data_state={}, config={})  # not on the interval
    for step in (2, 4, 6):
        assert ckpt.save(step, state, data_state={"next_sample": step}, config={})
    assert ckpt.save(7, state, data_state={"next_sample": 7}, config={}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [6, 7]
    assert sorted(os.listdir(tmp_path)) == ["6", "7"]
    assert not ckpt.should_save(6)  # already saved
    with pytest.raises(TypeError, match="'data'"):
        ckpt.save(8, state, data_state={"rng": np.zeros(2)}, config={})
    ckpt.close()


def test_latest_step_ignores_incomplete(tmp_path, mesh):
    assert Checkpointer(str(tmp_path / "missing"), every_steps=1, keep=3, read_only=True).latest_step() is None
    ckpt = Checkpointer(str(tmp_path / "ck"), every_steps=1, keep=3, async_save=False)
    assert ckpt.latest_step() is None
    state = _state(mesh)
    ckpt.save(5, state, data_state={"next_sample": 5}, config={})
    # A crash mid-save leaves Orbax's tmp directory (<step>.orbax-checkpoint-tmp); a hand-made or half-copied
    # step directory lacks the commit_success.txt marker. Neither counts.
    os.makedirs(tmp_path / "ck" / "8.orbax-checkpoint-tmp" / "state")
    os.makedirs(tmp_path / "ck" / "9" / "state")
    assert ckpt.latest_step() == 5 and ckpt.all_steps() == [5]
    _, data, _ = ckpt.restore(None, _abstract(state, lambda x: x.sharding))
    assert data == {"next_sample": 5}
    with pytest.raises(FileNotFoundError, match="step 9"):
        ckpt.restore(9, _abstract(state, lambda x: x.sharding))
    ckpt.close()
    # Re-opening for writing removes the stale tmp directory (in the background, awaited by the next save),
    # so step 8 can be saved again.
    ckpt = Checkpointer(str(tmp_path / "ck"), every_steps=1, keep=3, async_save=False)
    assert ckpt.save(8, state, data_state={}, config={})
    assert not (tmp_path / "ck" / "8.orbax-checkpoint-tmp").exists()
    assert ckpt.latest_step() == 8
    ckpt.close()


def test_structure_and_shape_mismatch_names_keys(tmp_path, mesh):
    state = _state(mesh)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False)
    ckpt.save(1, state, data_state={}, config={})

    def repl(x):
        return NamedSharding(mesh, P())

    extra = dict(_abstract(state, repl), extra_key=jax.ShapeDtypeStruct((2,), jnp.float32, sharding=repl(None)))
    with pytest.raises(ValueError, match="extra_key"):
        ckpt.restore(1, extra)

    missing = _abstract(state, repl)
    missing["params"] = {"w_DF": missing["params"]["w_DF"]}
    with pytest.raises(ValueError, match=r"params\.b_F"):
        ckpt.restore(1, missing)

    wrong_shape = _abstract(state, repl)
    wrong_shape["params"]["w_DF"] = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=repl(None))
    with pytest.raises(ValueError, match=r"params\.w_DF: checkpoint shape \(8, 16\) != target shape \(8, 32\)"):
        ckpt.restore(1, wrong_shape)

    wrong_dtype = _abstract(state, repl)
    wrong_dtype["params"]["b_F"] = jax.ShapeDtypeStruct((16,), jnp.bfloat16, sharding=repl(None))
    with pytest.raises(ValueError, match=r"params\.b_F: checkpoint dtype float32 != target dtype bfloat16"):
        ckpt.restore(1, wrong_dtype)

    no_sharding = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(ValueError, match="sharding"):
        ckpt.restore(1, no_sharding)
    ckpt.close()


def test_mismatch_is_a_structured_error(tmp_path, mesh):
    """The error carries the path, the step and every difference as data (nobody parses its message), and an
    optimizer state that differs only in empty nodes is caught before Orbax reads anything."""
    state = _state(mesh)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=1, async_save=False)
    ckpt.save(3, state, data_state={}, config={})

    def repl(x):
        return NamedSharding(mesh, P())

    target = _abstract(state, repl)
    target["params"]["w_DF"] = jax.ShapeDtypeStruct((8, 32), jnp.bfloat16, sharding=repl(None))
    target["opt_state"] = (*target["opt_state"], optax.EmptyState())  # one more (empty) optimizer stage
    with pytest.raises(CheckpointMismatchError) as err:
        ckpt.restore(None, target)
    e = err.value
    assert isinstance(e, ValueError) and e.step == 3 and e.path == str(tmp_path / "3" / "state")
    assert e.differences == (
        ArrayDifference("opt_state.2", None, EMPTY),
        ArrayDifference("params.w_DF", ((8, 16), "float32"), ((8, 32), "bfloat16")),
    )
    assert str(e.differences[1]) == (
        "params.w_DF: checkpoint shape (8, 16) != target shape (8, 32); checkpoint "
        "dtype float32 != target dtype bfloat16"
    )
    assert e.summary(1) == f"2 arrays differ, e.g. {e.differences[1]}"  # parameters first
    assert ckpt.all_steps() == [3]  # a mismatch is not damage: nothing set aside
    ckpt.close()


def test_async_save_then_wait_and_restore_from_path(tmp_path, mesh):
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=3, async_save=True)
    states = {s: _state(mesh, seed=s) for s in (1, 2)}
    for s, st in states.items():
        assert ckpt.save(s, st, data_state={"next_sample": 10 * s}, config={"seed": s})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()

    target = _abstract(states[1], lambda x: NamedSharding(mesh, P()))
    latest, data, config = restore_from_path(str(tmp_path), target)
    _assert_bitwise_equal(latest, states[2])
    assert data == {"next_sample": 20} and config == {"seed": 2}
    first, data, _ = restore_from_path(str(tmp_path / "1"), target)
    run_dir = tmp_path.parent / f"{tmp_path.name}_run"  # a run directory holding checkpoints/ works too
    os.makedirs(run_dir)
    os.symlink(tmp_path, run_dir / "checkpoints")
    assert restore_from_path(str(run_dir), target)[1] == {"next_sample": 20}
    _assert_bitwise_equal(first, states[1])
    assert data == {"next_sample": 10}
    # One resolution of a path for restores and for jaxpar-checkpoints; an unfinished save is no checkpoint.
    root = str(tmp_path)
    assert [resolve_checkpoint_path(str(p)) for p in (tmp_path, tmp_path / "1", run_dir)] == [
        (root, None),
        (root, 1),
        (str(run_dir / "checkpoints"), None),
    ]
    os.makedirs(tmp_path / "3.orbax-checkpoint-tmp" / "state")
    for use in (resolve_checkpoint_path, lambda p: restore_from_path(p, target)):
        with pytest.raises(FileNotFoundError, match=r"unfinished save .*pass its parent"):
            use(str(tmp_path / "3.orbax-checkpoint-tmp"))


def test_background_failure_surfaces_in_wait(tmp_path, mesh, monkeypatch):
    async def failing_finalize(self, *args, **kwargs):
        raise OSError("disk full (injected)")

    # The commit (write commit_success.txt, rename <step>.orbax-checkpoint-tmp -> <step>) runs in the background.
    monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", failing_finalize)
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=3, async_save=True)
    assert ckpt.save(3, _state(mesh), data_state={}, config={})  # returns before the failure
    with pytest.raises(OSError, match="injected"):
        ckpt.wait()
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    assert ckpt.should_save(3)  # the failed step may be retried
    ckpt.close()


# Orbax's background reader may report its closed event loop after the failed read: noise, not a result.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["truncate_arrays", "garble_metadata"])
def test_corrupted_latest_falls_back_to_previous_with_warning(tmp_path, mesh, damage, caplog):
    """A committed step whose files were damaged afterwards is skipped with a warning; the older step restores,
    the damaged directory is kept as <step>.corrupt, and the step can be saved again."""
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=3, async_save=False)
    old, new = _state(mesh, seed=0), _state(mesh, seed=1)
    ckpt.save(2, old, data_state={"next_sample": 2}, config={})
    ckpt.save(4, new, data_state={"next_sample": 4}, config={})
    state_dir = tmp_path / "4" / "state"
    files = [os.path.join(d, f) for d, _, fs in os.walk(state_dir) for f in fs]
    if damage == "truncate_arrays":
        targets = [f for f in files if "ocdbt" in f or "/d/" in f]
        assert targets, files
        for f in targets:
            open(f, "wb").close()
    else:
        targets = [f for f in files if os.path.basename(f) in ("_METADATA", "_sharding", "manifest.ocdbt")]
        assert targets, files
        for f in targets:
            with open(f, "wb") as fh:
                fh.write(b"\x00garbage{")
    assert ckpt.latest_step() == 4  # committed, so it is listed: only reading finds the damage
    with caplog.at_level(logging.WARNING, logger="jaxpar"):
        restored, data, _ = ckpt.restore(None, _abstract(old, lambda x: x.sharding))
    (record,) = [r for r in caplog.records if r.name == "jaxpar.checkpoint"]
    message = record.getMessage()
    assert record.levelname == "WARNING" and re.search("step 4 .* cannot be read: .*fell back to step 2", message)
    # one line in plain words: no TensorStore spec, no object repr
    assert "\n" not in message and not re.search("tensorstore_spec|<bound method|TensorStore\\(", message), message
    _assert_bitwise_equal(restored, old)
    assert data == {"next_sample": 2}
    assert sorted(os.listdir(tmp_path)) == ["2", "4.corrupt"]
    assert ckpt.latest_step() == 2
    assert ckpt.save(4, new, data_state={"next_sample": 4}, config={})  # not blocked by the damaged copy
    ckpt.close()


def test_unreadable_only_checkpoint_raises_and_renames_nothing(tmp_path, mesh):
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=3, async_save=False)
    state = _state(mesh)
    ckpt.save(3, state, data_state={}, config={})
    for d, _, fs in os.walk(tmp_path / "3" / "state"):
        for f in fs:
            open(os.path.join(d, f), "wb").close()
    with pytest.raises(ValueError, match="Expecting value"):  # the reader's own error (emptied JSON metadata)
        ckpt.restore(None, _abstract(state, lambda x: x.sharding))
    assert sorted(os.listdir(tmp_path)) == ["3"]
    ckpt.close()


def test_optional_fp8_entry_restores_starts_at_zeros_or_is_dropped(tmp_path, mesh, caplog):
    """FP8 delayed scaling's amax history ("fp8", `jaxpar.checkpoint.store.OPTIONAL_ENTRIES`): restored where
    saved with the target's shapes (onto another sharding too), zeros where the step holds none or another
    window, read and dropped where the target keeps none; the rest of the state restores bitwise each time."""
    state = _state(mesh)
    history = jax.device_put(jax.random.uniform(jax.random.key(1), (2, 7, 3, 4)), NamedSharding(mesh, P("data")))
    with_fp8 = {**state, "fp8": {"amax_history": history}}
    ckpt = Checkpointer(str(tmp_path), every_steps=1, keep=3, async_save=False)
    ckpt.save(1, with_fp8, data_state={}, config={})
    ckpt.save(2, state, data_state={}, config={})
    replicated = _abstract(with_fp8, lambda x: NamedSharding(mesh, P()))

    restored, _, _ = ckpt.restore(1, replicated)  # kept, resharded
    _assert_bitwise_equal(restored, with_fp8)
    assert restored["fp8"]["amax_history"].sharding == NamedSharding(mesh, P())
    with caplog.at_level(logging.INFO, logger="jaxpar.checkpoint"):
        dropped, _, _ = ckpt.restore(1, _abstract(state, lambda x: x.sharding))
        fresh, _, _ = ckpt.restore(2, replicated)
        wider = {
            **replicated,
            "fp8": {"amax_history": jax.ShapeDtypeStruct((2, 7, 3, 8), jnp.float32, sharding=NamedSharding(mesh, P()))},
        }
        refilled, _, _ = ckpt.restore(1, wider)
    _assert_bitwise_equal(dropped, state)
    _assert_bitwise_equal({k: v for k, v in fresh.items() if k != "fp8"}, state)
    np.testing.assert_array_equal(np.asarray(fresh["fp8"]["amax_history"]), np.zeros((2, 7, 3, 4), np.float32))
    np.testing.assert_array_equal(np.asarray(refilled["fp8"]["amax_history"]), np.zeros((2, 7, 3, 8), np.float32))
    _assert_bitwise_equal({k: v for k, v in refilled.items() if k != "fp8"}, state)
    text = caplog.text
    assert "does not keep" in text and "holds no 'fp8' entry" in text and "of other shapes" in text
    ckpt.close()
