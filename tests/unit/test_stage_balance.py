"""Stage FLOPs of a pipeline and the whole-layer split that balances them (`jaxpar.parallel.layer_split.stage_flops`
and `balanced_split`, reported by `jaxpar-plan` through `jaxpar.analysis.planner.plan.stage_balance`).
Pure arithmetic: the split is checked against every composition of small layer counts."""

import itertools
import os

import pytest

from jaxpar.analysis.planner.plan import plan
from jaxpar.config import load_config
from jaxpar.parallel.layer_split import balanced_split, stage_flops

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _busiest(counts, layer, head):
    return max(stage_flops(counts, layer, head))


def test_the_split_minimises_the_busiest_stage():
    """Against every split of up to 9 layers over 2 to 4 stages (each stage at least one layer), for heads worth
    0 to 6 layers: the balanced split's busiest stage is the least, and the split is a valid one."""
    for n, p in itertools.product(range(2, 10), range(2, 5)):
        if n < p:
            continue
        every = [c for c in itertools.product(range(1, n + 1), repeat=p) if sum(c) == n]
        for head in (0.0, 0.5, 1.0, 2.4, 6.0):
            split = balanced_split(n, p, 1.0, head)
            assert len(split) == p and sum(split) == n and min(split) >= 1, (n, p, head, split)
            assert _busiest(split, 1.0, head) == min(_busiest(c, 1.0, head) for c in every), (n, p, head, split)


def test_llama3_8b_at_four_stages():
    """The head worth 2.41 layers (llama3_8b's 128,256 x 4096 head over a layer's matmul FLOPs): the last stage
    takes 6 layers, and the busiest stage is 9/8.6 = 1.046x the mean, not less: whole layers cannot do better."""
    split = balanced_split(32, 4, 1.0, 2.41)
    loads = stage_flops(split, 1.0, 2.41)
    assert split[-1] == 6 and sorted(split) == [6, 8, 9, 9]
    assert max(loads) / (sum(loads) / 4) == pytest.approx(9 / 8.6025, rel=1e-6)
    assert stage_flops((2, 2), 1.0, 3.0, embed_flops=0.5) == [2.5, 5.0]


def test_bad_sizes():
    with pytest.raises(ValueError, match="need 1 <= p <= n_layers"):
        balanced_split(2, 4, 1.0, 1.0)
    with pytest.raises(ValueError, match="one entry per stage"):
        stage_flops((), 1.0, 1.0)


def test_plan_reports_the_stage_flops():
    """The 32k-vocabulary benchmark shape (4 layers, d_model 256, p = 2): the head costs 9.6 layers, the busiest
    stage under the even split is 1.706x the mean, the figure benchmarks/pipeline.py measures from the compiled
    program as "max FLOPs/dp" of the zero-bubble rows (docs/parallelism.md), and the best whole-layer split (3, 1)
    only brings it to 1.56x."""
    overrides = ["mesh.pipeline=2", "mesh.fsdp=1", "mesh.tensor=1", "mesh.data=1", "model.vocab_size=32000"]
    overrides += ["model.d_model=256", "model.d_ff=768", "model.n_layers=4", "data.seq_len=128"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), overrides, num_devices=2)
    balance = plan(cfg, "cpu")["pipeline"]["stage_balance"]
    assert balance["balanced_split"] == [3, 1]
    assert balance["even"] == pytest.approx(1.706, abs=5e-4) and balance["balanced"] == pytest.approx(1.559, abs=5e-4)
    single = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), ["mesh.fsdp=2"], num_devices=8)
    assert plan(single, "cpu")["pipeline"]["stage_balance"] is None
