"""A script's own data iterator (jaxpar.data.IteratorLoader): global batches from process-local ones, exact resume
from the iterator's own state (a Grain dataset iterator and a bytes-state iterator), and clear errors."""

from __future__ import annotations

import grain
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.data import IteratorLoader

G, T = 8, 6


def _sharding():
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    return NamedSharding(mesh, P("data", None))


def _grain_iterator(seed: int = 3):
    """Grain: 40 sequences of T tokens, shuffled, batched G at a time into the batch dict."""
    rows = np.arange(40 * (T + 1), dtype=np.int64).reshape(40, T + 1) % 97
    ds = (
        grain.MapDataset.source(list(rows))
        .shuffle(seed=seed)
        .map(lambda r: {"inputs": r[:-1], "targets": r[1:], "loss_mask": np.ones(T, np.float32)})
    )
    return iter(ds.to_iter_dataset().batch(G))


def test_global_batches_and_exact_resume_from_a_grain_iterator():
    sharding = _sharding()
    loader = IteratorLoader(_grain_iterator(), G, T, sharding)
    assert loader.local_rows == G  # one process holds every row
    first = loader.next_batch()
    assert first["inputs"].shape == (G, T) and first["inputs"].dtype == np.int32
    assert first["loss_mask"].dtype == np.float32 and first["inputs"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(first["targets"])[:, :-1], np.asarray(first["inputs"])[:, 1:])
    loader.next_batch()
    state = loader.get_state()
    want = [loader.next_batch() for _ in range(2)]
    resumed = IteratorLoader(_grain_iterator(), G, T, sharding)
    resumed.set_state(state)
    got = [resumed.next_batch() for _ in range(2)]
    for a, b in zip(got, want):
        for k in a:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    # the third batch differs from the first: the state really moved the iterator
    assert not np.array_equal(np.asarray(want[0]["inputs"]), np.asarray(first["inputs"]))


class BytesState:
    """An iterator whose state is bytes, as grain.DataLoader's iterators give."""

    def __init__(self):
        self.k = 0

    def __next__(self):
        self.k += 1
        x = np.full((G, T), self.k, np.int64)
        return {"inputs": x, "targets": x + 1, "loss_mask": np.ones((G, T))}

    def get_state(self):
        return f'{{"k": {self.k}}}'.encode()

    def set_state(self, state):
        self.k = int(state.decode().split(":")[1].rstrip("}"))


def test_bytes_state_round_trips_through_json():
    import json

    loader = IteratorLoader(BytesState(), G, T, _sharding())
    loader.next_batch()
    state = json.loads(json.dumps(loader.get_state()))  # what a checkpoint stores
    other = IteratorLoader(BytesState(), G, T, _sharding())
    other.set_state(state)
    assert int(np.asarray(other.next_batch()["inputs"])[0, 0]) == 2


def test_bad_iterators_and_batches_are_named():
    with pytest.raises(TypeError, match="lacks get_state, set_state"):
        IteratorLoader(iter([]), G, T, _sharding())
    loader = IteratorLoader(BytesState(), G, T, _sharding())
    wrong = [
        ({"inputs": np.zeros((G, T), np.int32)}, r"keys \['inputs', 'targets', 'loss_mask'\]"),
        (
            {
                "inputs": np.zeros((4, T), np.int32),
                "targets": np.zeros((4, T), np.int32),
                "loss_mask": np.zeros((4, T)),
            },
            r"batch\['inputs'\] has shape \(4, 6\).*expected \(8, 6\)",
        ),
        (
            {"inputs": np.zeros((G, T)), "targets": np.zeros((G, T), np.int32), "loss_mask": np.zeros((G, T))},
            "must hold integer token ids, got float64",
        ),
    ]
    for batch, message in wrong:
        loader.iterator = iter([batch])  # next_batch only draws from it
        with pytest.raises(ValueError, match=message):
            loader.next_batch()


def test_state_of_another_process_count():
    loader = IteratorLoader(BytesState(), G, T, _sharding())
    same = {"processes": [{"bytes": '{"k": 4}'}, {"bytes": '{"k": 4}'}]}
    loader.set_state(same)  # equal states: the position does not depend on the process
    assert loader.iterator.k == 4
    with pytest.raises(
        ValueError,
        match="holds the data iterator states of 2 processes, which differ, but this "
        "run has 1; resume with 2 processes",
    ):
        loader.set_state({"processes": [{"bytes": '{"k": 4}'}, {"bytes": '{"k": 5}'}]})
    with pytest.raises(ValueError, match="must be {'processes'"):
        loader.set_state({"next_sample": 3})
