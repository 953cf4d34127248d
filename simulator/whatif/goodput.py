"""Goodput of a long training run with failures, checkpoints and restarts.

Model (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
Future Generation Computer Systems 22(3), eq. 12-13): failures of the whole job arrive as a Poisson
process of rate ``lambda = gpus / mtbf_per_gpu`` (independent GPU failures, each one stops the
synchronous job). Work runs in segments of ``tau`` seconds, each followed by a blocking checkpoint
of ``delta`` seconds. A failure loses the segment in progress and costs ``restart`` seconds before
work resumes from the last checkpoint. The expected wall time of one segment is then exactly

    E[T] = (1/lambda + restart) * (exp(lambda * (tau + delta)) - 1)

and the goodput (useful fraction of wall time) is ``tau / E[T]``. Failures during a restart are
ignored, as in Daly's model; at real rates (restart << 1/lambda) that is a small term.

The first-order optimum ``tau = sqrt(2 delta / lambda)`` is Young's (1974, CACM 17(9)); Daly's
higher-order optimum is used when ``delta < 2 / lambda``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.errors import UserError


@dataclass(frozen=True)
class FailurePolicy:
    """How the job survives a failed node."""

    mtbf_per_gpu_h: float  # mean time between failures of ONE GPU (with its share of host, NIC, links), hours
    checkpoint_interval_s: float  # work between checkpoints (tau)
    checkpoint_cost_s: float  # blocking time to write one checkpoint (delta)
    restart_cost_s: float  # detect, reschedule (or swap in a spare), reload the checkpoint, warm up

    def check(self) -> "FailurePolicy":
        for name in ("mtbf_per_gpu_h", "checkpoint_interval_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise UserError(f"{name}={value} must be a positive, finite number")
        for name in ("checkpoint_cost_s", "restart_cost_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise UserError(f"{name}={value} must be a finite number of seconds, at least 0")
        return self


@dataclass(frozen=True)
class Goodput:
    gpus: int
    job_mtbf_s: float  # 1 / lambda: mean time between failures of the whole job
    goodput: float  # useful work / wall time
    lost_to_failures: float  # fraction of wall time lost to rework and restarts
    lost_to_checkpoints: float  # fraction of wall time spent writing checkpoints
    failures_per_day: float
    cost_per_failure_s: float  # expected wall time one failure costs: restart + rework
    optimal_checkpoint_interval_s: float


def job_failure_rate_per_s(gpus: int, mtbf_per_gpu_h: float) -> float:
    return gpus / (mtbf_per_gpu_h * 3600.0)


def expected_segment_time_s(tau_s: float, delta_s: float, restart_s: float, rate_per_s: float) -> float:
    """Daly (2006) eq. 12: expected wall time to complete tau of work plus its checkpoint."""
    if rate_per_s == 0:
        return tau_s + delta_s
    return (1.0 / rate_per_s + restart_s) * math.expm1(rate_per_s * (tau_s + delta_s))


def optimal_checkpoint_interval_s(delta_s: float, rate_per_s: float) -> float:
    """Daly (2006) eq. 37 (higher-order), falling back to 1/lambda when delta >= 2/lambda."""
    mtbf = 1.0 / rate_per_s
    if delta_s >= 2 * mtbf:
        return mtbf
    x = math.sqrt(delta_s / (2 * mtbf))
    return math.sqrt(2 * delta_s * mtbf) * (1 + x / 3 + x * x / 9) - delta_s


def goodput(gpus: int, policy: FailurePolicy) -> Goodput:
    policy.check()
    if gpus < 1:
        raise UserError(f"gpus={gpus} must be at least 1")
    rate = job_failure_rate_per_s(gpus, policy.mtbf_per_gpu_h)
    tau, delta, restart = policy.checkpoint_interval_s, policy.checkpoint_cost_s, policy.restart_cost_s
    segment = expected_segment_time_s(tau, delta, restart, rate)
    useful = tau / segment
    checkpoints = delta / segment
    # Failures in one segment: (exp(lambda (tau + delta)) - 1) on average (Daly's renewal argument),
    # each costing restart plus the rework the segment time above accounts for.
    failures_per_segment = math.expm1(rate * (tau + delta))
    lost = 1.0 - useful - checkpoints
    cost_per_failure = lost * segment / failures_per_segment if failures_per_segment > 0 else 0.0
    return Goodput(
        gpus=gpus,
        job_mtbf_s=1.0 / rate,
        goodput=useful,
        lost_to_failures=lost,
        lost_to_checkpoints=checkpoints,
        failures_per_day=rate * 86400.0,
        cost_per_failure_s=cost_per_failure,
        optimal_checkpoint_interval_s=optimal_checkpoint_interval_s(delta, rate),
    )
