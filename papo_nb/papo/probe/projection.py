"""The probe's projection test: how much of each PAPO term's gradient is in ``g_zero - g_parent``.

A gamma-zero path that leaks a term ``T_k`` (perception KL, the original or the masked entropy) adds ``c_k * grad T_k``
to the difference ``d = g_zero - g_parent``; roundoff adds a vector with no preferred direction. So the leak
coefficients are the least-squares fit ``d ~ sum_k c_k g_k`` over the terms' gradients: with the Gram matrix
``G = [<g_k, g_l>_w]``, ``c = G^-1 [<g_k, d>_w]``, in an inner product weighted per element by how much roundoff the
element's sum can carry (``_weights``). The spec's norm rule sees a leak only when ``c_k ||g_k||`` exceeds
``REL_TOL * ||g_parent||``, which on a trained policy (large parent gradient, small perception gradient) is a
coefficient of order 1; the projection sees ``c_k`` directly, whatever the parent gradient.

Noise floor. Roundoff of one gradient element is independent of the others, so the projection of roundoff ``r`` on
the terms has covariance ``G^-1 S G^-1`` with ``S = [sum_i w_i^2 g_k,i g_l,i v_i]``, ``v_i`` the variance of element
``i``, taken from the *measured* roundoff samples (``roundoff.py``), the mean of ``r_i^2``, plus the fp32
representation error of the parent gradient, ``(eps_fp32 * g_parent,i)^2`` (no gradient held in fp32 resolves
less). The noise floor of ``c_k`` is the square root of the diagonal, or the root mean square of the coefficients
fitted to the measured samples themselves where that is larger (correlated roundoff, few elements). A leak is seen
when ``|c_k| > PROJECTION_Z * floor_k``, and that threshold is the smallest coefficient this test detects.

Power by injection. In bf16 a leak 1000x below the parent gradient can be rounded away inside the backward (each
activation gradient is rounded with the parent's part in it), which no roundoff floor shows. So the probe also
injects a value-neutral leak of ``RECIPE_GAMMA`` x each term into the same pass and counts the term powered only when
that leak measures at least ``POWER_MARGIN`` noise floors.

A term whose gradient is exactly 0 on the batch (no autograd path: an entropy weighted 0 under the full estimator,
the masked branch without gradient; or an image-invariant batch) cannot be tested: it is reported as such, never
divided by.

Every sum here is over parameters, so under FSDP2 (each rank holds a disjoint piece) the local sums are all-reduced
in one collective (``reduce.global_sums``) before any division: every rank computes the same coefficients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..recipes import RECIPES

# Detection threshold in noise floors: a roundoff projection beyond 6 sigma has probability 2e-9 per term if
# Gaussian, so 50 probe evaluations of 3 terms stay clear of false alarms with room for heavier tails.
PROJECTION_Z = 6.0
# A term is powered when a leak at the recipe's gamma, injected on the batch, measures at least this many noise
# floors: seen with margin (20 floors = 3.3x the detection threshold), not just over the line.
POWER_MARGIN = 20.0
# The official PAPO-G 3B and 7B recipes' gamma (0.02): a leak of any term at that weight must be detectable for a
# batch to count as powered.
RECIPE_GAMMA = RECIPES["papo_g_3b"]["perception_loss_weight"]
FP32_EPS = torch.finfo(torch.float32).eps
# A term whose gradient keeps less than this fraction of its norm once the other terms' gradients are projected out
# is (numerically) a combination of them: its coefficient is not identifiable.
COLLINEAR_FRACTION = 1e-6
# Ridge of the per-element weights, as a fraction of the mean squared magnitude: keeps elements whose sums cancel to
# (near) zero from taking all the weight (measured on the testbed: the fitted noise floors then hold, <= 3.6 sigma).
WEIGHT_RIDGE = 1e-2
TERM_NAMES = ("perception_kl", "original_entropy", "masked_entropy")

NO_GRAPH = "not testable for this term: it has no autograd path to the trainable weights on this batch"
ZERO_GRADIENT = "not testable for this term: its gradient is exactly 0 on this batch"
COLLINEAR = "not testable for this term: its gradient is a combination of the other terms' gradients"


def _weights(magnitude: torch.Tensor, reduce_sums) -> torch.Tensor:
    """Per-element weights ``1 / (m_i + WEIGHT_RIDGE * mean(m))``: roundoff grows with the magnitudes an element's
    sum rounds at, so quiet elements count more (a weighted fit; the floor below stays measured). Uniform if the
    parent gradient is 0 everywhere."""
    total, count = reduce_sums(torch.stack([magnitude.sum(), torch.tensor(float(magnitude.numel()))]).double())
    if total.item() == 0:
        return torch.ones_like(magnitude)
    return 1.0 / (magnitude + WEIGHT_RIDGE * total.item() / count.item())


def _leak_sums(ds, injected, g_parent, samples, magnitude, term_grads, reduce_sums):
    """Every sum the fit needs, in one collective: the terms' squared norms, the weighted Gram matrix, the weighted
    projections of the differences, injections and samples, and the roundoff covariance ``S``."""
    names = [k for k, g in term_grads.items() if g is not None]
    k, width = len(names), len(ds) + len(names) + len(samples)
    weights = _weights(magnitude, reduce_sums)
    variance = torch.stack([r * r for r in samples]).mean(0) + (FP32_EPS * g_parent) ** 2
    grads = torch.stack([term_grads[n] for n in names]) if names else torch.zeros(0, g_parent.numel()).double()
    targets = torch.stack([*ds, *[injected[n] for n in names], *samples])
    weighted = grads * weights
    local = torch.cat(
        [
            (grads * grads).sum(-1),
            (weighted @ grads.T).reshape(-1),
            (weighted @ targets.T).reshape(-1),
            ((weighted * variance) @ weighted.T).reshape(-1),
        ]
    ).double()
    sums = reduce_sums(local)
    plain, sums = sums[:k], sums[k:]
    gram, sums = sums[: k * k].view(k, k), sums[k * k :]
    return plain, gram, sums[: k * width].view(k, width), sums[k * width :].view(k, k)


def _testable_terms(names, term_grads, plain, gram) -> tuple[dict[str, dict], list[int]]:
    """The entry of every term that cannot be tested (no graph, zero gradient, a combination of the earlier terms:
    Gram-Schmidt on the weighted Gram matrix), and the indices into ``names`` of those that can."""
    base: dict[str, dict] = {n: dict(testable=False, reason=NO_GRAPH, grad_norm=0.0) for n in term_grads}
    kept: list[int] = []
    for i, name in enumerate(names):
        if plain[i].item() == 0:
            base[name] = dict(testable=False, reason=ZERO_GRADIENT, grad_norm=0.0)
            continue
        if kept:
            cross = gram[kept, i]
            residual = gram[i, i] - cross @ torch.linalg.solve(gram[kept][:, kept], cross)
            if residual.item() <= COLLINEAR_FRACTION**2 * gram[i, i].item():
                base[name] = dict(testable=False, reason=COLLINEAR, grad_norm=math.sqrt(plain[i].item()))
                continue
        kept.append(i)
    return base, kept


def term_leaks(
    ds: list[torch.Tensor],
    injected: dict[str, torch.Tensor],
    g_parent: torch.Tensor,
    samples: list[torch.Tensor],
    magnitude: torch.Tensor,
    term_grads: dict[str, torch.Tensor | None],
    tolerance: float,
    reduce_sums: Callable[[torch.Tensor], torch.Tensor],
) -> list[dict[str, dict]]:
    """Per difference in ``ds`` (one per assembly) and per term: the gradient norm, the estimated leak coefficient,
    its noise floor, the smallest coefficient this test detects, the one the norm rule detects
    (``tolerance / ||g_k||``), whether a leak is seen, and the power measured by injection: ``injected[k]`` is the
    difference of the first assembly plus a value-neutral ``RECIPE_GAMMA`` leak of term k, and the term is powered when
    that leak is seen (bf16 can round a small leak away, which no noise floor shows). A term with None gradient has no
    graph; ``reduce_sums`` sums local sums over ranks."""
    names = [k for k, g in term_grads.items() if g is not None]
    plain, gram, projections, noise = _leak_sums(ds, injected, g_parent, samples, magnitude, term_grads, reduce_sums)
    base, kept = _testable_terms(names, term_grads, plain, gram)
    out = [{n: dict(e) for n, e in base.items()} for _ in ds]
    if not kept:
        return out
    inverse = torch.linalg.inv(gram[kept][:, kept])
    coefficients = inverse @ projections[kept]  # (kept terms, ds + injections)
    modelled = (inverse @ noise[kept][:, kept] @ inverse).diagonal().clamp(min=0)
    # The measured samples' own coefficients: where few elements carry a term (or roundoff is correlated across
    # elements, as bf16 rounding of a shared activation gradient is), their spread exceeds the elementwise model.
    empirical = coefficients[:, len(ds) + len(names) :].pow(2).mean(-1)
    floors = torch.maximum(modelled, empirical).sqrt()
    for j, i in enumerate(kept):
        name, grad_norm, floor = names[i], math.sqrt(plain[i].item()), floors[j].item()
        detectable = PROJECTION_Z * floor
        # The injected leak as this test measures it: the coefficient it adds on top of the first assembly's.
        injected_coefficient = coefficients[j, len(ds) + i].item() - coefficients[j, 0].item()
        unpowered = power_shortfall(injected_coefficient, floor, detectable)
        for v, leaks in enumerate(out):
            coefficient = coefficients[j, v].item()
            leaks[name] = dict(
                testable=True,
                reason=None,
                grad_norm=grad_norm,
                coefficient=coefficient,
                noise_floor=floor,
                detectable_coefficient=detectable,
                norm_rule_detectable_coefficient=tolerance / grad_norm,
                statistic=abs(coefficient) / detectable if detectable > 0 else (0.0 if coefficient == 0 else math.inf),
                leak_seen=abs(coefficient) > detectable,
                injected_leak_coefficient=injected_coefficient,
                injected_leak_over_floor=injected_coefficient / floor if floor > 0 else math.inf,
                powered=unpowered is None,
                power_shortfall=unpowered,
                margin_at_recipe_gamma=RECIPE_GAMMA / detectable if detectable > 0 else math.inf,
            )
    return out


def power_shortfall(injected_coefficient: float, floor: float, detectable: float) -> str | None:
    """Why a term is not powered on this batch, or None when it is: the injected ``RECIPE_GAMMA`` leak must be seen
    in the assembled gradient (a coefficient above 0) and measure at least ``POWER_MARGIN`` noise floors, against a
    floor above 0. A floor of exactly 0 (nothing measured where the term's gradient lies) makes any leak look
    infinitely many floors tall and every coefficient "detectable at 0"; it proves nothing, so it never powers."""
    if injected_coefficient == 0:
        return (
            f"the injected {RECIPE_GAMMA} leak rounds away entirely (measured coefficient exactly 0): the probe "
            "cannot see a leak on this batch"
        )
    if floor == 0:
        return "the noise floor is exactly 0: no roundoff was measured to set the leak against"
    if injected_coefficient < POWER_MARGIN * floor:
        return (
            f"the injected {RECIPE_GAMMA} leak measures {injected_coefficient / floor:.3g} < {POWER_MARGIN:g} floors"
        )
    if detectable > RECIPE_GAMMA:
        return f"the smallest detectable coefficient {detectable:.3g} is above the recipe's gamma {RECIPE_GAMMA}"
    return None


def powered(leaks: dict[str, dict]) -> bool:
    """Powered: the perception term is testable and, for every testable term, a value-neutral leak of
    ``RECIPE_GAMMA`` injected on this batch measures at least ``POWER_MARGIN`` noise floors (so ``RECIPE_GAMMA`` is
    also above the detection threshold)."""
    tested = [e for e in leaks.values() if e["testable"]]
    return leaks.get("perception_kl", {}).get("testable", False) and all(e["powered"] for e in tested)


def leak_assembly(assemble: Callable, term: str, scale: float = RECIPE_GAMMA) -> Callable:
    """``assemble`` plus a value-neutral leak of one PAPO term: ``scale * (T - T.detach())`` is 0.0 in value and
    ``scale * grad T`` in gradient (nothing when the term has no graph)."""

    def leaking(parent_loss, terms, gamma, eta1, eta2):
        tensor = getattr(terms, term)
        return assemble(parent_loss, terms, gamma, eta1, eta2) + scale * (tensor - tensor.detach())

    return leaking


def describe(leaks: dict[str, dict]) -> str:
    """One line per term for a probe message."""
    parts = []
    for name, e in leaks.items():
        if not e["testable"]:
            parts.append(f"{name}: {e['reason']}")
        else:
            parts.append(
                f"{name}: c = {e['coefficient']:.3e} (floor {e['noise_floor']:.2e}, detectable "
                f"{e['detectable_coefficient']:.2e}, injected {RECIPE_GAMMA} measures "
                f"{e['injected_leak_over_floor']:.3g} floors; norm rule detects "
                f"{e['norm_rule_detectable_coefficient']:.2e})"
                + (f", not powered: {e['power_shortfall']}" if e["power_shortfall"] else "")
            )
    return "; ".join(parts)


def flat_metrics(leaks: dict[str, dict], prefix: str = "projection") -> dict[str, float]:
    """``projection/<term>/<number>`` for MLflow; an untestable term logs ``testable = 0`` and nothing else."""
    out = {}
    for name, e in leaks.items():
        out[f"{prefix}/{name}/testable"] = float(e["testable"])
        for key, value in e.items():
            if key not in ("testable", "reason") and isinstance(value, (int, float)):
                out[f"{prefix}/{name}/{key}"] = float(value)
    return out


def term_tensors(terms) -> dict[str, torch.Tensor]:
    return {name: getattr(terms, name) for name in TERM_NAMES}


def term_gradients(
    terms, gradient_of: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
) -> dict[str, torch.Tensor | None]:
    """Each term's flat gradient, None for a term that has no graph (the same on every rank: under FSDP a backward is
    a collective, so the set of terms differentiated must not depend on the rank's data)."""
    tensors = term_tensors(terms)
    with_graph = [name for name, t in tensors.items() if t.requires_grad]
    grads = dict(zip(with_graph, gradient_of([tensors[n] for n in with_graph])))
    return {name: grads.get(name) for name in tensors}
