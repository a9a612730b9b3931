"""The probe's detection threshold: how many noise floors a leak coefficient must measure to be called a leak.

The noise floor of a coefficient is estimated from ``k`` measured roundoff samples: it is at least the root mean
square of the coefficients fitted to the samples themselves. Where roundoff is correlated across elements (bf16
rounding of a shared activation gradient, GPU atomics), that empirical term dominates, and the statistic
``coefficient / floor`` is then a Student t with ``k`` degrees of freedom, not a Gaussian: with ``k = 2``,
``P(|t| > 6)`` is 2.7%, not 2e-9. So the threshold is the Student-t quantile for ``k`` degrees of freedom at the
false-alarm rate of one test, ``FALSE_ALARM_RATE / tests`` (Bonferroni over every test of the evaluation: each
term's whole gradient and each (block, term) pair), two-sided.

Why "at most": the floor is ``max(modelled, empirical)`` (a larger floor only lowers the statistic), and the samples
share the parent pass with the tested difference, which correlates numerator and denominator and thins the tail
(simulated: 0.57-0.77 of the nominal rate at 1e-3 for k = 2..8, Gaussian roundoff).
"""

from __future__ import annotations

import math
from functools import lru_cache

# The probe's false-alarm budget per evaluation (one batch, every term and block together): a false alarm raises
# ProbeFailure and stops a healthy run, so it must be rare against the few evaluations a run makes.
FALSE_ALARM_RATE = 1e-3


def student_t_two_sided_tail(t: float, dof: int) -> float:
    """``P(|T| > t)`` for a Student t with integer ``dof`` >= 1 degrees of freedom, in closed form
    (Abramowitz & Stegun 26.7.3 and 26.7.4: a finite series in ``cos(theta)``, ``theta = atan(t / sqrt(dof))``)."""
    if dof < 1 or int(dof) != dof:
        raise ValueError(f"dof={dof!r} is not a whole number of degrees of freedom; allowed: integers >= 1")
    theta = math.atan(abs(t) / math.sqrt(dof))
    cos2, term, series = math.cos(theta) ** 2, 1.0, 1.0
    if dof % 2 == 0:  # even: sin(theta) (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ... up to cos^(dof-2))
        for j in range(1, dof // 2):
            term *= cos2 * (2 * j - 1) / (2 * j)
            series += term
        inside = math.sin(theta) * series
    else:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2.4/(3.5) cos^4 + ... up to cos^(dof-3)))
        for j in range(1, (dof - 1) // 2):
            term *= cos2 * (2 * j) / (2 * j + 1)
            series += term
        extra = math.sin(theta) * math.cos(theta) * series if dof > 1 else 0.0
        inside = 2 / math.pi * (theta + extra)
    return max(0.0, 1.0 - inside)


@lru_cache(maxsize=256)
def student_t_quantile(tail: float, dof: int) -> float:
    """The ``t`` with ``P(|T_dof| > t) = tail`` (two-sided), by bisection on the closed-form tail."""
    if not 0 < tail < 1:
        raise ValueError(f"tail={tail!r} is not a probability strictly between 0 and 1")
    low, high = 0.0, 1.0
    while student_t_two_sided_tail(high, dof) > tail:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if student_t_two_sided_tail(middle, dof) > tail else (low, middle)
    return high


def detection_threshold(samples: int, tests: int, rate: float = FALSE_ALARM_RATE) -> float:
    """The threshold in noise floors for one test among ``tests``, with a floor from ``samples`` roundoff samples,
    so that all ``tests`` together false-alarm at most ``rate`` per evaluation."""
    if samples < 1:
        raise ValueError(f"samples={samples!r}: the noise floor needs at least 1 roundoff sample")
    return student_t_quantile(rate / max(tests, 1), samples)
