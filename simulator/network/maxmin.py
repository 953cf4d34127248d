"""Max-min fair rates by progressive filling, vectorised over a sparse link x flow matrix.

All unfrozen flows grow at the same pace until some link fills; the flows crossing a full link
freeze at their current rate; repeat. Each round is two sparse mat-vecs, and the number of
rounds is the number of distinct bottleneck levels (a handful for collective traffic), so tens
of thousands of flows solve in milliseconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

# scipy.sparse is imported where a matrix is built, not at the top: it takes ~0.3 s (with the
# numpy.f2py its array-API shim loads), and only the flow model needs it.
if TYPE_CHECKING:
    import scipy.sparse as sp

_REL_TOL = 1e-9
# Vectorised rounds before switching to the heap: collective traffic needs a handful.
_VECTOR_ROUNDS = 40


def maxmin_rates(incidence: sp.spmatrix, capacity: np.ndarray, active: np.ndarray | None = None,
                 transposed: sp.csr_matrix | None = None) -> np.ndarray:
    """Rates (same unit as capacity) of the flows (columns of ``incidence``, links x flows).

    active: flows that take part; the others get rate 0. Every active flow must cross at
    least one link of positive capacity. transposed: ``incidence.T`` as CSR, if the caller
    keeps one (it is reused across re-solves).
    """
    import scipy.sparse as sp  # (see the note at the imports)

    n_links, n_flows = incidence.shape
    rate = np.zeros(n_flows)
    act = np.ones(n_flows, dtype=bool) if active is None else np.asarray(active, dtype=bool).copy()
    if not act.any():
        return rate
    A = incidence.tocsr() if not sp.isspmatrix_csr(incidence) else incidence
    AT = transposed if transposed is not None else A.T.tocsr()
    rem = np.asarray(capacity, dtype=np.float64).copy()
    # Work on the sub-problem of active flows and the links they use; shrink it whenever half
    # of its flows have frozen, so traffic with many bottleneck levels stays near-linear.
    flows = np.nonzero(act)[0]
    links = np.nonzero((A @ act.astype(np.float64)) > 0.5)[0]
    A = A[links][:, flows]
    AT = A.T.tocsr()
    rem = rem[links]
    tol = _REL_TOL * np.maximum(rem, 1e-300)
    act = np.ones(flows.size, dtype=bool)
    level = 0.0
    for round_ in range(n_links + 1):
        if round_ == _VECTOR_ROUNDS:
            # Many distinct bottleneck levels (irregular traffic): finish event by event.
            _fill_by_heap(A, AT, rem, act, level, flows, rate)
            break
        cnt = A @ act.astype(np.float64)
        used = cnt > 0.5
        if not used.any():
            break
        share = np.full(cnt.size, np.inf)
        share[used] = rem[used] / cnt[used]
        inc = float(share.min())
        level += inc
        rem[used] -= inc * cnt[used]
        sat = used & (rem <= tol + _REL_TOL * inc * cnt)
        frozen = act & ((AT @ sat.astype(np.float64)) > 0.5)
        rate[flows[frozen]] = level
        act &= ~frozen
        n_act = int(act.sum())
        if n_act == 0:
            break
        if n_act * 2 < act.size:
            keep_l = np.nonzero(used & ~sat)[0]
            keep_f = np.nonzero(act)[0]
            A = A[keep_l][:, keep_f]
            AT = A.T.tocsr()
            rem, tol = rem[keep_l], tol[keep_l]
            flows = flows[keep_f]
            act = np.ones(keep_f.size, dtype=bool)
    return rate


def _fill_by_heap(A: sp.csr_matrix, AT: sp.csr_matrix, rem: np.ndarray, act: np.ndarray, level: float,
                  flows: np.ndarray, rate: np.ndarray) -> None:
    """Progressive filling one bottleneck at a time, with a heap of link saturation levels.

    Active flows all sit at ``level``; link l saturates when the level reaches
    level + rem[l] / cnt[l]. Freezing a flow lowers cnt on its links, which only raises their
    saturation levels, so stale heap entries are skipped by a version check.
    """
    import heapq

    a_ptr, a_idx = A.indptr.tolist(), A.indices.tolist()
    t_ptr, t_idx = AT.indptr.tolist(), AT.indices.tolist()
    active = act.tolist()
    cnt = (A @ act.astype(np.float64)).round().astype(np.int64).tolist()
    # spare[l]: capacity left above what the active flows use at the current level
    spare = rem.tolist()
    base = level
    heap = [(base + spare[l] / cnt[l], l) for l in range(len(cnt)) if cnt[l] > 0]
    heapq.heapify(heap)
    # sat level of l = base_l + spare_l / cnt_l, kept as an absolute number per link
    sat_level = [base + spare[l] / cnt[l] if cnt[l] > 0 else float("inf") for l in range(len(cnt))]
    out = {}
    while heap:
        lvl, l = heapq.heappop(heap)
        if cnt[l] == 0 or lvl != sat_level[l]:
            continue
        for k in range(a_ptr[l], a_ptr[l + 1]):
            f = a_idx[k]
            if not active[f]:
                continue
            active[f] = False
            out[f] = lvl
            for j in range(t_ptr[f], t_ptr[f + 1]):
                m = t_idx[j]
                if cnt[m] == 0 or m == l:
                    continue
                # the flow stops growing at lvl: the link keeps (sat_level - lvl) * cnt spare
                left = (sat_level[m] - lvl) * cnt[m]
                cnt[m] -= 1
                if cnt[m] > 0:
                    sat_level[m] = lvl + left / cnt[m]
                    heapq.heappush(heap, (sat_level[m], m))
                else:
                    sat_level[m] = float("inf")
        cnt[l] = 0
    if out:
        idx = np.fromiter(out.keys(), dtype=np.int64, count=len(out))
        rate[flows[idx]] = np.fromiter(out.values(), dtype=np.float64, count=len(out))


def maxmin_dense(counts: np.ndarray, capacity: np.ndarray, ceiling: np.ndarray | None = None) -> np.ndarray:
    """Weighted max-min levels of a few coflows over the links they touch, dense and numpy-only.

    counts: (links, coflows); coflow c at level x puts x * counts[l, c] on link l (counts are
    "equivalent flows": a coflow's bytes on the link over its per-flow bytes, so the level is
    the bandwidth each of its flows gets, as in the per-flow model). capacity: (links,).
    ceiling: (coflows,), the highest level each coflow can use (its isolated speed), inf for
    none. Every coflow must touch a link of positive capacity or have a finite ceiling.
    Rounds are at most the number of coflows, each a (links x coflows) mat-vec: the fabric
    re-solves this at every event, so it must stay far below the per-flow solve.
    """
    K = np.asarray(counts, dtype=np.float64)
    n_links, n_c = K.shape
    out = np.zeros(n_c)
    if n_c == 0:
        return out
    ceil = np.full(n_c, np.inf) if ceiling is None else np.asarray(ceiling, dtype=np.float64)
    rem = np.asarray(capacity, dtype=np.float64).copy()
    tol = _REL_TOL * np.maximum(rem, 1e-300)
    act = np.ones(n_c, dtype=bool)
    level = 0.0
    for _ in range(n_c + 1):
        cnt = K @ act.astype(np.float64)
        used = cnt > 0
        inc = np.inf
        if used.any():
            inc = float(np.min(rem[used] / cnt[used]))
        inc = min(inc, float(ceil[act].min()) - level)
        if not np.isfinite(inc):
            raise ValueError("a coflow touches no link of positive capacity and has no ceiling")
        inc = max(inc, 0.0)
        level += inc
        rem[used] -= inc * cnt[used]
        sat = used & (rem <= tol + _REL_TOL * inc * cnt)
        frozen = act & (ceil <= level * (1 + _REL_TOL))
        if sat.any():
            frozen |= act & (K[sat].sum(axis=0) > 0)
        out[frozen] = level
        act &= ~frozen
        if not act.any():
            break
    return out
