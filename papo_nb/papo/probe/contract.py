"""The gamma-zero probe's constants from the spec (requirements, not tuning knobs).

The TRL private-API contract the trainer checks at construction stays in the core (``papo/contract.py``): the
adapter needs it with or without this probe.
"""

from __future__ import annotations

# Gamma-zero probe tolerance: ||g_zero - g_parent|| <= max(REL_TOL * ||g_parent||, ABS_FLOOR).
# REL_TOL is ~2x the bf16 backward roundoff seen on a resumed (trained) policy (2.4% relative);
# ABS_FLOOR covers parents so small that REL_TOL * parent falls below that roundoff. A real leak
# is of the order of the perception gradient, i.e. ~100% of the parent, far above both.
GAMMA_ZERO_GRADIENT_REL_TOL = 5e-2
GAMMA_ZERO_GRADIENT_ABS_FLOOR = 1e-6
