"""Hugging Face weights read by the slice (`jaxpar.model.hf.lazy`, `jaxpar.model.hf.place`): on sharded meshes of 8
simulated devices every fixture family's parameters come out bit for bit as the eager `load_hf` reads them, each
element of the files read exactly once (what a process's devices hold, replicas read once); the slice reads and the
streamed writes of `jaxpar.model.hf.files` against safetensors' own; `init_state` takes placed parameters without a
second copy. The multi-process case (each process reading only its own slices) is
tests/system/test_hf_processes.py."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from hf_helpers import FAMILY_FIXTURES, TIED, UNTIED
from safetensors import safe_open
from step_helpers import to_host

from jaxpar.config import load_config
from jaxpar.model.hf import check_hf, load_hf
from jaxpar.model.hf.files import TensorFiles, read_header, write_streamed
from jaxpar.model.hf.lazy import HFSliceReader
from jaxpar.model.hf.place import addressable_blocks, place_hf_params
from jaxpar.model.hf.weights import INDEX_FILE, write_hf_tensors
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.plan import build_plan
from jaxpar.training.state import abstract_params, init_state

FIXTURES = [UNTIED, TIED, *FAMILY_FIXTURES.values()]


def _layouts(model) -> dict[str, list[str]]:
    """Two layouts of 8 devices: data x fsdp x tensor at ZeRO-1 (the fp32 parameters replicated over data: each
    block placed twice, read once), and data x pipeline x fsdp at ZeRO-3 with the 16p layout (the master copy over
    data too, layers split over the stages). A fixture of one key/value head takes fsdp=4 for tensor=2."""
    tensor = ["mesh.fsdp=2", "mesh.tensor=2"] if model.kv_heads % 2 == 0 else ["mesh.fsdp=4", "mesh.tensor=1"]
    return {
        "data2_fsdp_tensor_zero1": ["mesh.data=2", *tensor, "mesh.pipeline=1", "optimizer.zero_stage=1"],
        "data2_pipeline2_fsdp2_zero3_16p": [
            "mesh.data=2",
            "mesh.pipeline=2",
            "mesh.fsdp=2",
            "mesh.tensor=1",
            "optimizer.zero_stage=3",
            "precision.layout=16p",
        ],
    }


def _plan(model, overrides):
    cfg = load_config({"model": dataclasses.asdict(model)}, [*overrides, "train.global_batch_size=8"], num_devices=8)
    return build_plan(cfg, build_mesh(cfg, jax.devices()[:8]))


@pytest.mark.parametrize("layout", ["data2_fsdp_tensor_zero1", "data2_pipeline2_fsdp2_zero3_16p"])
@pytest.mark.parametrize("fixture", FIXTURES, ids=os.path.basename)
def test_lazy_load_is_the_eager_load_bit_for_bit(fixture, layout, devices8):
    model = check_hf(fixture)
    plan = _plan(model, _layouts(model)[layout])
    target = abstract_params(plan)
    with HFSliceReader(fixture, model) as reader:
        params = place_hf_params(reader, target)
        read, total, itemsize = reader.bytes_read, reader.total_bytes, 2 if reader.stored_dtype != "float32" else 4
    # Read: the distinct blocks this process's devices hold, in the stored dtype. One process holds all 8
    # devices, so that is every element of the files exactly once, however the blocks are replicated.
    blocks = sum(
        int(np.prod([b - a for a, b in bounds])) * itemsize
        for t in jax.tree.leaves(target)
        for bounds in addressable_blocks(tuple(t.shape), t.sharding)
    )
    placed = sum(s.data.size * itemsize for x in jax.tree.leaves(params) for s in x.addressable_shards)
    assert read == blocks == total and placed > total  # replicas placed, not read again
    eager = load_hf(fixture).params
    for (path, got), want, t in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(eager), jax.tree.leaves(target)
    ):
        assert got.sharding == t.sharding and got.dtype == np.float32, path
        host = np.asarray(got)
        assert host.shape == want.shape and host.tobytes() == want.astype(np.float32).tobytes(), path


def test_init_state_takes_placed_parameters_without_a_copy(devices8):
    """The optimizer state comes out of the jitted program on the plan's shardings; the donated parameters become
    the state's (deleted as inputs) and the state is the one placed host parameters give."""
    model = check_hf(UNTIED)
    plan = _plan(model, _layouts(model)["data2_fsdp_tensor_zero1"])
    with HFSliceReader(UNTIED, model) as reader:
        params = place_hf_params(reader, abstract_params(plan))
    state = init_state(plan, params=params, donate=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    want = init_state(plan, params=load_hf(UNTIED).params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(to_host(a), to_host(b)), state, want)
    assert jax.tree.map(lambda x: x.sharding, state) == plan.state_shardings


def test_a_stack_stored_with_zero_rows_reads_them_as_zeros(devices8):
    """2 layers over 4 pipeline stages (pipeline.stage_layers [1, 1, 0, 0]) are stored as 4 rows, the last 2 zero
    (`jaxpar.parallel.layer_split.stored_rows`): placed from the files, the real rows are the eager load's."""
    model = check_hf(UNTIED)
    plan = _plan(model, ["mesh.data=2", "mesh.pipeline=4", "pipeline.stage_layers=[1,1,0,0]"])
    assert plan.stack_rows == 4 and model.stack_depth == 2
    with HFSliceReader(UNTIED, model) as reader:
        params = place_hf_params(reader, abstract_params(plan))
    eager = load_hf(UNTIED).params
    for got, want in zip(jax.tree.leaves(params["blocks"]), jax.tree.leaves(eager["blocks"])):
        host = np.asarray(got)
        assert host.shape == (4, *want.shape[1:]) and not np.any(host[2:])
        np.testing.assert_array_equal(host[:2], want)


@pytest.mark.parametrize("backend", ["pread", "safetensors"])
def test_slice_reads_are_numpy_slicing(backend, tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "m": rng.standard_normal((37, 11)).astype(ml_dtypes.bfloat16),
        "v": rng.standard_normal(29).astype(np.float32),
    }
    files = write_hf_tensors(tensors, str(tmp_path))
    names = {n: str(tmp_path / files[0]) for n in tensors}
    with TensorFiles(names, backend) as f:
        got = f.read("m", [(3, 9), (20, 37)], [(0, 2), (5, 11)])
        want = np.block([[tensors["m"][a:b, c:d] for c, d in [(0, 2), (5, 11)]] for a, b in [(3, 9), (20, 37)]])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
        whole_rows = f.read("m", [(4, 6)])
        assert whole_rows.tobytes() == tensors["m"][4:6].tobytes()
        runs = np.concatenate([tensors["v"][2:5], tensors["v"][7:8]])
        assert f.read("v", [(2, 5), (7, 8)]).tobytes() == runs.tobytes()
        assert f.bytes_read == (23 * 8 + 2 * 11) * 2 + 4 * 4
        with pytest.raises(ValueError, match=r"range \[30, 38\) outside its shape \(37, 11\)"):
            f.read("m", [(30, 38)])


def test_streamed_files_are_laid_out_as_save_hf_lays_them(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.standard_normal((i + 3, 5)).astype(np.float16) for i in range(6)}
    specs = {n: ("float16", w.shape) for n, w in tensors.items()}
    streamed = write_streamed(str(tmp_path / "a"), specs, iter(tensors.values()), max_shard_bytes=120)
    whole = write_hf_tensors(tensors, str(tmp_path / "b"), max_shard_bytes=120)
    assert streamed == whole and len(streamed) > 2 and streamed[-1] == INDEX_FILE
    index = json.loads((tmp_path / "a" / INDEX_FILE).read_text())
    assert index == json.loads((tmp_path / "b" / INDEX_FILE).read_text())
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / "a" / file), "numpy") as f:  # safetensors' own reader takes the files
            assert f.get_tensor(name).tobytes() == tensors[name].tobytes()
        assert read_header(str(tmp_path / "a" / file))[name].shape == tensors[name].shape
    with pytest.raises(Exception, match="its header says float16"):
        write_streamed(str(tmp_path / "c"), specs, iter([tensors["t0"].astype(np.float32)]))
    assert os.listdir(tmp_path / "c") == []  # nothing half-written left behind


def test_a_target_of_another_model_is_refused(devices8):
    model = check_hf(UNTIED)
    target = abstract_params(_plan(model, _layouts(model)["data2_fsdp_tensor_zero1"]))
    del target["lm_head"]
    with HFSliceReader(UNTIED, model) as reader:
        with pytest.raises(ValueError, match=r"not in the target: \['lm_head/kernel'\]"):
            place_hf_params(reader, target)
