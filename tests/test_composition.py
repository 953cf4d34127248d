"""vTrain's rows read as a composition of per-layer, per-microbatch and per-step terms."""

import itertools

import pytest

from simulator.calibrate.composition import (TERMS, fit_terms, label_layout, layer_times,
                                             mape_with_published_terms)
from simulator.calibrate.published import PublishedRow, PublishedValidation, read_table


def _label(h, L, tp, dp, pp, mb, gb):
    return f"h{h} L{L} tp{tp} dp{dp} pp{pp} mb{mb} gb{gb}"


def _synthetic(published_terms, predicted_terms):
    """Rows of one layout group whose times are exactly the given four terms."""
    rows = []
    for L, gb in itertools.product((12, 16, 20, 24), (4, 8, 16, 32)):
        n = gb // 2  # micro batch 2, dp 1
        basis = (n * L, n, L, 1)
        pub = sum(c * x for c, x in zip(published_terms, basis))
        pred = sum(c * x for c, x in zip(predicted_terms, basis))
        rows.append(PublishedRow(_label(1024, L, 2, 1, 2, 2, gb), 4, pub, pred))
    return PublishedValidation("vtrain-single-node", rows)


def test_fit_recovers_the_terms_and_the_oracle_moves_only_the_chosen_ones():
    published = (1.5e-3, 3.0e-3, 1.6e-3, 2.0e-3)
    predicted = (1.8e-3, 2.0e-3, 1.6e-3, 2.0e-3)  # layer term 20% high, microbatch term 1/3 low
    v = _synthetic(published, predicted)
    (fit,) = fit_terms(v)
    assert fit.full_rank and fit.rows == 16
    assert fit.published_s == pytest.approx(published, rel=1e-9)
    assert fit.predicted_s == pytest.approx(predicted, rel=1e-9)
    assert fit.published_residual < 1e-12
    assert fit.layer_time_published_s == pytest.approx(2 * published[0])  # pp 2: a stage holds half the layers
    assert mape_with_published_terms(v, [fit], ()) == pytest.approx((v.mape, v.mean_signed_error))
    both = mape_with_published_terms(v, [fit], (0, 1))
    assert both[0] == pytest.approx(0.0, abs=1e-12)
    layer_only = mape_with_published_terms(v, [fit], (0,))
    # Right layer term, still the low microbatch term: every row too fast.
    assert 0 < layer_only[0] < v.mape and layer_only[1] < 0
    assert len(TERMS) == 4


def test_shipped_vtrain_rows_are_composed_from_one_layer_time_per_cell():
    # Published times only (predicted = published): a fact of the data, no simulation.
    rows = []
    for r in read_table("vtrain-single-node"):
        t = float(r["iteration time (ms)"]) / 1e3
        rows.append(PublishedRow(_label(r["hidden size"], r["# layers"], r["tensor parallelism"],
                                        r["data parallelism"], r["pipeline parallelism"], r["micro batch"],
                                        r["global batch"]), int(r["# GPUs"]), t, t))
    fits = fit_terms(PublishedValidation("vtrain-single-node", rows))
    assert len(fits) == 144 and sum(f.rows for f in fits) == 1440
    assert max(f.published_residual for f in fits if f.dp == 1) < 1e-12
    # With dp > 1 the gradient all-reduce is not linear in the layers: some residual shows.
    assert max(f.published_residual for f in fits if f.dp > 1) > 1e-6
    # Micro batch 8 groups have one microbatch count: their terms cannot be separated.
    assert {f.micro_batch for f in fits if not f.full_rank} == {8}
    assert all(set(f.ties) == {frozenset({0, 2}), frozenset({1, 3})} for f in fits if not f.full_rank)
    cells = layer_times(fits)
    assert len(cells) == 24
    for pub, _ in cells.values():
        assert (max(pub) - min(pub)) / min(pub) < 1e-9


def test_label_layout_refuses_a_row_that_is_not_vtrains():
    assert label_layout("h1024 L24 tp1 dp1 pp2 mb8 gb16") == dict(h=1024, L=24, tp=1, dp=1, pp=2, mb=8, gb=16)
    with pytest.raises(ValueError, match=r"lacks L, gb: not a vTrain row"):
        label_layout("h1024 tp1 dp1 pp2 mb8")


def test_a_group_of_one_microbatch_count_moves_the_terms_it_cannot_separate_together():
    # Micro batch 8 groups: every row has the same n, so a*n*L + c*L and b*n + d are all it sees.
    rows = []
    for L in (12, 16, 20, 24):
        pub = 1.5e-3 * 2 * L + 3.0e-3 * 2 + 1.6e-3 * L + 2.0e-3
        pred = 1.8e-3 * 2 * L + 2.0e-3 * 2 + 1.6e-3 * L + 2.0e-3
        rows.append(PublishedRow(_label(1024, L, 2, 1, 2, 8, 16), 4, pub, pred))  # n = 16 / 8 = 2
    v = PublishedValidation("vtrain-single-node", rows)
    (fit,) = fit_terms(v)
    assert fit.rank == 2 and not fit.full_rank
    assert set(fit.ties) == {frozenset({0, 2}), frozenset({1, 3})}
    from simulator.calibrate.composition import identified_terms
    assert identified_terms(fit, (0,)) == {0, 2}
    # The per-layer part (a*n + c) is the published one: only the microbatch part's miss is left,
    # whatever split the least-squares fit chose inside each tie.
    layer_only = mape_with_published_terms(v, [fit], (0,))
    expected = [((1.5e-3 * 2 * L + 1.6e-3 * L) + (2.0e-3 * 2 + 2.0e-3))
                / (1.5e-3 * 2 * L + 3.0e-3 * 2 + 1.6e-3 * L + 2.0e-3) - 1 for L in (12, 16, 20, 24)]
    assert layer_only[1] == pytest.approx(sum(expected) / 4, rel=1e-9)
    assert mape_with_published_terms(v, [fit], (0, 1))[0] == pytest.approx(0.0, abs=1e-12)
