"""jaxpar.analysis.bench.loss_band: a treatment's largest same-seed difference against the reference's seed range."""

import pytest

from jaxpar.analysis.bench.loss_band import compare_to_band


def test_band_gap_and_ratio_per_logged_step():
    ref = {1: {10: 3.0, 20: 2.5}, 2: {10: 3.2, 20: 2.6}, 3: {10: 3.1, 20: 2.4}}
    trt = {1: {10: 3.05, 20: 2.5}, 2: {10: 3.2, 20: 2.9}, 3: {10: 3.1, 20: 2.4}}
    out = compare_to_band(ref, trt)
    assert out["steps"] == [10, 20]
    assert out["band"] == pytest.approx([0.2, 0.2])
    assert out["gap"] == pytest.approx([0.05, 0.3])
    assert out["ratio"] == pytest.approx([0.25, 1.5])
    assert out["worst_step"] == 20 and out["within_range"] == 1
    # per-step sample variances 0.01 and 0.01: pooled std 0.1, band 0.2; the gap 0.3 at step 20 is outside
    assert out["std"] == pytest.approx(0.1) and out["pooled_band"] == pytest.approx(0.2) and not out["within"]
    assert out["mean_gap"] == pytest.approx((0.05 + 0.3) / 6)


def test_needs_the_same_seeds_and_a_common_step():
    with pytest.raises(ValueError, match="same >= 2 seeds"):
        compare_to_band({1: {1: 1.0}}, {1: {1: 1.0}})
    with pytest.raises(ValueError, match="same >= 2 seeds"):
        compare_to_band({1: {1: 1.0}, 2: {1: 1.0}}, {1: {1: 1.0}, 3: {1: 1.0}})
    with pytest.raises(ValueError, match="no step"):
        compare_to_band({1: {1: 1.0}, 2: {2: 1.0}}, {1: {1: 1.0}, 2: {2: 1.0}})
