"""vTrain's single-node rows read as the composition they are.

Within each layout group (tp, pp, dp, micro batch, hidden size) vTrain's 1,440 published
iteration times (validation/vtrain-single-node-a100.csv) are an exact linear function of the
number of layers L and of microbatches per step n:

    step = a * n * L  +  b * n  +  c * L  +  d

to a relative residual of ~1e-15 where dp = 1 (~1e-3 where dp > 1: the gradient all-reduce's
time is not linear in L). Real end-to-end runs scatter by a percent or more from run to run, so
the rows were composed from a few measured terms, not each timed. The per-layer-and-microbatch
term a, times pp, is the same number in every pp and dp group of a (tp, micro batch, hidden)
cell: 24 measured layer times underlie all 1,440 rows, and the per-microbatch term b is one
number per (tp, micro batch, hidden) for pp >= 2.

Fitting the same four terms to the simulator's predictions says which cost a miss is in: the
layer (a), what runs once a microbatch outside the layers (b: embedding, LM head, loss, the
pipeline's per-microbatch work), or once a step (c, d: optimizer, gradient reduction, the
pipeline's fill and drain). ``mape_with_published_terms`` gives the set's MAPE were some of the
predicted terms replaced by the published ones: how much of the miss each term holds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from simulator.calibrate.published import PublishedValidation

# The basis of a group's fit, in the order of a TermFit's coefficients.
TERMS = ("per layer and microbatch", "per microbatch", "per layer a step", "per step")
_LAYOUT = re.compile(r"(?:^|\s)(h|L|tp|dp|pp|mb|gb)(\d+)(?=\s|$)")


def label_layout(label: str) -> dict[str, int]:
    """The layout numbers of a vTrain row label ("h1024 L24 tp1 dp1 pp2 mb8 gb16")."""
    found = dict((k, int(v)) for k, v in _LAYOUT.findall(label))
    missing = [k for k in ("h", "L", "tp", "dp", "pp", "mb", "gb") if k not in found]
    if missing:
        raise ValueError(f"row label {label!r} lacks {', '.join(missing)}: not a vTrain row")
    return found


@dataclass(frozen=True)
class TermFit:
    """The four terms of one layout group, fitted to the published and to the predicted rows."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    hidden: int
    rows: int
    # Rank of the group's design matrix: 4 where the group's layers and microbatch counts vary
    # enough to separate every term (micro batch 8 groups have one microbatch count: rank 2).
    rank: int
    published_s: tuple[float, float, float, float]
    predicted_s: tuple[float, float, float, float]
    # Largest |published - fit| / published over the group's rows: ~1e-15 for a composed group.
    published_residual: float

    @property
    def full_rank(self) -> bool:
        return self.rank == len(TERMS)

    @property
    def layer_time_published_s(self) -> float:
        """One layer's forward, recomputation and backward for one microbatch: a x pp (a stage
        holds L / pp layers)."""
        return self.published_s[0] * self.pp

    @property
    def layer_time_predicted_s(self) -> float:
        return self.predicted_s[0] * self.pp


def _design(layers: np.ndarray, microbatches: np.ndarray) -> np.ndarray:
    return np.column_stack([microbatches * layers, microbatches, layers, np.ones_like(layers)])


def fit_terms(v: PublishedValidation) -> list[TermFit]:
    """One TermFit per (tp, pp, dp, micro batch, hidden) group of a vTrain validation's rows."""
    groups: dict[tuple[int, int, int, int, int], list[tuple[float, float, float, float]]] = {}
    for r in v.rows:
        if math.isnan(r.error):
            continue
        lay = label_layout(r.label)
        microbatches = lay["gb"] // (lay["mb"] * lay["dp"])
        key = (lay["tp"], lay["pp"], lay["dp"], lay["mb"], lay["h"])
        groups.setdefault(key, []).append((lay["L"], microbatches, r.published_step_time_s, r.predicted_step_time_s))
    fits = []
    for (tp, pp, dp, mb, h), rows in sorted(groups.items()):
        a = np.array(rows, dtype=float)
        x = _design(a[:, 0], a[:, 1])
        published = np.linalg.lstsq(x, a[:, 2], rcond=None)[0]
        predicted = np.linalg.lstsq(x, a[:, 3], rcond=None)[0]
        residual = float(np.max(np.abs(a[:, 2] - x @ published) / a[:, 2]))
        fits.append(TermFit(tp, pp, dp, mb, h, len(rows), int(np.linalg.matrix_rank(x)),
                            tuple(float(c) for c in published), tuple(float(c) for c in predicted), residual))
    return fits


def layer_times(fits: list[TermFit]) -> dict[tuple[int, int, int], tuple[list[float], list[float]]]:
    """(tp, micro batch, hidden) -> (published, predicted) layer times in seconds, one per full-rank
    group: the published ones are one number repeated where the rows were composed."""
    out: dict[tuple[int, int, int], tuple[list[float], list[float]]] = {}
    for f in fits:
        if f.full_rank:
            pub, pred = out.setdefault((f.tp, f.micro_batch, f.hidden), ([], []))
            pub.append(f.layer_time_published_s)
            pred.append(f.layer_time_predicted_s)
    return out


def mape_with_published_terms(v: PublishedValidation, fits: list[TermFit], terms: tuple[int, ...]) -> tuple[float, float]:
    """(MAPE, mean signed error) over the rows were the predicted ``terms`` (indices into TERMS)
    the published ones, the other terms kept as predicted. No terms: the set's own figures."""
    by_key = {(f.tp, f.pp, f.dp, f.micro_batch, f.hidden): f for f in fits}
    errors = []
    for r in v.rows:
        if math.isnan(r.error):
            continue
        lay = label_layout(r.label)
        microbatches = lay["gb"] // (lay["mb"] * lay["dp"])
        f = by_key[(lay["tp"], lay["pp"], lay["dp"], lay["mb"], lay["h"])]
        basis = _design(np.array([float(lay["L"])]), np.array([float(microbatches)]))[0]
        # Move only the chosen terms: the row's own prediction keeps what the fit leaves over.
        shift = sum((f.published_s[i] - f.predicted_s[i]) * basis[i] for i in terms)
        errors.append((r.predicted_step_time_s + shift) / r.published_step_time_s - 1.0)
    if not errors:
        return math.nan, math.nan
    return float(np.mean(np.abs(errors))), float(np.mean(errors))
