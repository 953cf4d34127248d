"""vTrain's single-node rows read as the composition they are.

Within each layout group (tp, pp, dp, micro batch, hidden size) vTrain's 1,440 published
iteration times (validation/vtrain-single-node-a100.csv) are an exact linear function of the
number of layers L and of microbatches per step n:

    step = a * n * L  +  b * n  +  c * L  +  d

to a relative residual of ~1e-15 where dp = 1 (~1e-3 where dp > 1: the gradient all-reduce's
time is not linear in L). Real end-to-end runs scatter by a percent or more from run to run, so
the rows were composed from a few measured terms, not each timed. The per-layer-and-microbatch
term a, times pp, is the same number in every pp and dp group of a (tp, micro batch, hidden)
cell: 24 measured layer times underlie the 1,296 rows at micro batch 1, 2 and 4, and the
per-microbatch term b is one number per (tp, micro batch, hidden) for pp >= 2. At micro batch 8
each group has one microbatch count n, so its rows see only a*n + c and b*n + d: those terms
cannot be separated there (``TermFit.ties``).

Fitting the same four terms to the simulator's predictions says which cost a miss is in: the
layer (a), what runs once a microbatch outside the layers (b: embedding, LM head, loss, the
pipeline's per-microbatch work), or once a step (c, d: optimizer, gradient reduction, the
pipeline's fill and drain). ``mape_with_published_terms`` gives the set's MAPE were some of the
predicted terms replaced by the published ones: how much of the miss each term holds.
"""

from __future__ import annotations

import itertools
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
    # The design matrix (rows x TERMS) and a basis of its null space: directions in which the
    # terms can move without changing any row (a group with one microbatch count n sees only
    # a*n + c per layer and b*n + d per step). No basis where every term is identified.
    design: tuple[tuple[float, ...], ...] = ()
    null_space: tuple[tuple[float, ...], ...] = ()

    @property
    def ties(self) -> tuple[frozenset[int], ...]:
        """Sets of terms the group's rows cannot tell apart (each a smallest set that moves alone)."""
        out = {identified_terms(self, (i,)) for i in range(len(TERMS))}
        return tuple(sorted((t for t in out if len(t) > 1), key=sorted))

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
                            tuple(float(c) for c in published), tuple(float(c) for c in predicted), residual,
                            tuple(tuple(float(c) for c in row) for row in x), _null_space(x)))
    return fits


def _null_space(x: np.ndarray) -> tuple[tuple[float, ...], ...]:
    _, sv, vt = np.linalg.svd(x)
    rank = int(np.sum(sv > sv[0] * 1e-10)) if sv.size else 0
    return tuple(tuple(float(c) for c in v) for v in vt[rank:])


def identified_terms(fit: TermFit, terms: tuple[int, ...]) -> frozenset[int]:
    """The smallest set of terms containing ``terms`` whose substitution the group's rows define:
    moving its terms by any least-squares split changes every row alike, i.e. X v_S = 0 for every
    null-space direction v restricted to S. Where all terms are identified, ``terms`` itself."""
    if not fit.null_space:
        return frozenset(terms)
    x, null = np.array(fit.design), np.array(fit.null_space)
    tol = 1e-9 * float(np.abs(x).max())
    others = [i for i in range(len(TERMS)) if i not in terms]
    for extra in range(len(others) + 1):
        for add in itertools.combinations(others, extra):
            mask = np.zeros(len(TERMS))
            mask[list(terms) + list(add)] = 1.0
            if np.all(np.abs(x @ (null * mask).T) <= tol):
                return frozenset(terms) | frozenset(add)
    return frozenset(range(len(TERMS)))


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
    the published ones, the other terms kept as predicted. No terms: the set's own figures. In a
    group that cannot separate a chosen term from another (one microbatch count: micro batch 8),
    both move (``identified_terms``)."""
    by_key = {(f.tp, f.pp, f.dp, f.micro_batch, f.hidden): f for f in fits}
    errors = []
    for r in v.rows:
        if math.isnan(r.error):
            continue
        lay = label_layout(r.label)
        microbatches = lay["gb"] // (lay["mb"] * lay["dp"])
        f = by_key[(lay["tp"], lay["pp"], lay["dp"], lay["mb"], lay["h"])]
        basis = _design(np.array([float(lay["L"])]), np.array([float(microbatches)]))[0]
        # Move only the chosen terms (with those the group cannot tell them from): the row's own
        # prediction keeps what the fit leaves over.
        shift = sum((f.published_s[i] - f.predicted_s[i]) * basis[i] for i in identified_terms(f, terms))
        errors.append((r.predicted_step_time_s + shift) / r.published_step_time_s - 1.0)
    if not errors:
        return math.nan, math.nan
    return float(np.mean(np.abs(errors))), float(np.mean(errors))
