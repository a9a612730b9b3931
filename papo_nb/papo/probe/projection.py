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
when ``|c_k| > threshold * floor_k``, and that is the smallest coefficient this test detects. The threshold
(``threshold.py``) is the Student-t quantile for the number of roundoff samples, at ``FALSE_ALARM_RATE`` (1e-3)
divided over every test of the evaluation, so the whole probe false-alarms at most at that rate per evaluation.

Blocks (``blocks.py``). The same fit is made within each named parameter group (each LoRA layer, the vision merger,
the LM head, ...): a leak confined to a block holding a fraction ``f`` of a term's squared norm shows in the whole
fit as ``f * c`` but in the block's own fit as ``c``. Each (block, term) pair is one more test of the Bonferroni
count. Power is decided on the whole-gradient fit; each block reports its floor and detectable coefficient.

Power by injection. In bf16 a leak 1000x below the parent gradient can be rounded away inside the backward (each
activation gradient is rounded with the parent's part in it), which no roundoff floor shows. So the probe also
injects a value-neutral leak of ``RECIPE_GAMMA`` x each term into the same pass and counts the term powered only when
that leak measures at least ``POWER_MARGIN`` noise floors.

A term whose gradient is exactly 0 on the batch (no autograd path: an entropy weighted 0 under the full estimator,
the masked branch without gradient; or an image-invariant batch) cannot be tested: it is reported as such, never
divided by.

Every sum here is over parameters, so under FSDP2 (each rank holds a disjoint piece) the local sums of every block
are all-reduced in one collective (``reduce.global_sums``) before any division: every rank computes the same
coefficients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..recipes import RECIPES
from .blocks import Blocks, whole
from .threshold import FALSE_ALARM_RATE, detection_threshold

# A term is powered when a leak at the recipe's gamma, injected on the batch, measures at least this many noise
# floors, and the threshold times the floor is at most the recipe's gamma: seen with margin (20 floors is 2.5-3x
# the thresholds of 8 samples), not just over the line.
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
# Blocks holding at least this share of a term's squared gradient norm must be powered too (``blocks_powered``): a
# leak confined to one of them must be seen. Smaller blocks are tested and reported, not required.
BLOCK_SHARE = 0.01

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


@dataclass
class _Sums:
    """One fit's sums: the terms' squared norms, the weighted Gram matrix, the weighted projections of the targets
    (differences, injections, samples) and the roundoff covariance ``S``."""

    plain: torch.Tensor
    gram: torch.Tensor
    projections: torch.Tensor
    noise: torch.Tensor


def _leak_sums(ds, injected, g_parent, samples, magnitude, term_grads, reduce_sums, blocks: Blocks):
    """Every sum the fits need, per block and in one collective; the whole-gradient sums are their total."""
    names = [k for k, g in term_grads.items() if g is not None]
    k, width = len(names), len(ds) + len(names) + len(samples)
    weights = _weights(magnitude, reduce_sums)
    variance = torch.stack([r * r for r in samples]).mean(0) + (FP32_EPS * g_parent) ** 2
    grads = torch.stack([term_grads[n] for n in names]) if names else torch.zeros(0, g_parent.numel()).double()
    targets = torch.stack([*ds, *[injected[n] for n in names], *samples])
    pieces = []
    for start, stop, _ in blocks.segments:
        g, w = grads[:, start:stop], weights[start:stop]
        weighted = g * w
        pieces.append(
            torch.cat(
                [
                    (g * g).sum(-1),
                    (weighted @ g.T).reshape(-1),
                    (weighted @ targets[:, start:stop].T).reshape(-1),
                    ((weighted * variance[start:stop]) @ weighted.T).reshape(-1),
                ]
            ).double()
        )
    local = torch.zeros(len(blocks.names), k + 2 * k * k + k * width, dtype=torch.float64)
    local.index_add_(0, blocks.segment_index(), torch.stack(pieces).cpu())
    per_block = reduce_sums(local.to(g_parent.device)).cpu()

    def unpack(row):
        return _Sums(
            row[:k],
            row[k : k + k * k].view(k, k),
            row[k + k * k : k + k * k + k * width].view(k, width),
            row[k + k * k + k * width :].view(k, k),
        )

    return unpack(per_block.sum(0)), [unpack(row) for row in per_block]


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


def _fit(names, term_grads, sums: _Sums, n_ds: int):
    """The least-squares coefficients of the testable terms on every target, and each one's noise floor: the larger
    of the elementwise model ``G^-1 S G^-1`` and the root mean square of the samples' own coefficients."""
    base, kept = _testable_terms(names, term_grads, sums.plain, sums.gram)
    if not kept:
        return base, kept, None, None
    inverse = torch.linalg.inv(sums.gram[kept][:, kept])
    coefficients = inverse @ sums.projections[kept]  # (kept terms, ds + injections + samples)
    modelled = (inverse @ sums.noise[kept][:, kept] @ inverse).diagonal().clamp(min=0)
    # The measured samples' own coefficients: where few elements carry a term (or roundoff is correlated across
    # elements, as bf16 rounding of a shared activation gradient is), their spread exceeds the elementwise model.
    empirical = coefficients[:, n_ds + len(names) :].pow(2).mean(-1)
    return base, kept, coefficients, torch.maximum(modelled, empirical).sqrt()


def _statistic(coefficient: float, detectable: float) -> float:
    return abs(coefficient) / detectable if detectable > 0 else (0.0 if coefficient == 0 else math.inf)


@dataclass
class LeakTests:
    """The projection test of one batch: per difference (one per assembly) the whole-gradient entry of each term
    (``terms``) and each block's (``blocks``: block name -> term -> entry), and the threshold all of them share:
    ``threshold`` floors, the Student-t quantile for ``samples`` roundoff samples at ``FALSE_ALARM_RATE / tests``."""

    terms: list[dict[str, dict]]
    blocks: list[dict[str, dict[str, dict]]]
    threshold: float
    tests: int
    samples: int
    false_alarm_rate: float


def leak_tests(
    ds: list[torch.Tensor],
    injected: dict[str, torch.Tensor],
    g_parent: torch.Tensor,
    samples: list[torch.Tensor],
    magnitude: torch.Tensor,
    term_grads: dict[str, torch.Tensor | None],
    tolerance: float,
    reduce_sums: Callable[[torch.Tensor], torch.Tensor],
    blocks: Blocks | None = None,
    false_alarm_rate: float = FALSE_ALARM_RATE,
) -> LeakTests:
    """Per difference in ``ds`` (one per assembly) and per term: the gradient norm, the estimated leak coefficient,
    its noise floor, the smallest coefficient this test detects, the one the norm rule detects
    (``tolerance / ||g_k||``), whether a leak is seen, and the power measured by injection: ``injected[k]`` is the
    difference of the first assembly plus a value-neutral ``RECIPE_GAMMA`` leak of term k, and the term is powered when
    that leak is seen (bf16 can round a small leak away, which no noise floor shows). The same per block of
    ``blocks`` (more than one). A term with None gradient has no graph; ``reduce_sums`` sums local sums over ranks."""
    names = [k for k, g in term_grads.items() if g is not None]
    blocks = blocks or whole(g_parent.numel())
    total, per_block = _leak_sums(ds, injected, g_parent, samples, magnitude, term_grads, reduce_sums, blocks)
    fits = [_fit(names, term_grads, total, len(ds))]
    if len(blocks.names) > 1:
        fits += [_fit(names, term_grads, sums, len(ds)) for sums in per_block]
    tests = sum(len(kept) for _, kept, _, _ in fits)
    threshold = detection_threshold(len(samples), tests, false_alarm_rate)
    terms = _term_entries(names, fits[0], total, len(ds), threshold, tolerance)
    block_entries = [{} for _ in ds]
    for block, fit, sums in zip(blocks.names, fits[1:], per_block):
        for v, entry in enumerate(_block_entries(names, fit, sums, total, len(ds), threshold)):
            block_entries[v][block] = entry
    return LeakTests(terms, block_entries, threshold, tests, len(samples), false_alarm_rate)


def term_leaks(*args, **options) -> list[dict[str, dict]]:
    """``leak_tests(...).terms``: the whole-gradient entries alone."""
    return leak_tests(*args, **options).terms


def _fitted(names, fit, n_ds: int, threshold: float):
    """``(difference index, term index, entry)`` of every testable term of one fit: coefficient, floor, detectable
    coefficient, statistic, whether a leak is seen, and the power measured by the injected leak."""
    _, kept, coefficients, floors = fit
    for j, i in enumerate(kept):
        floor = floors[j].item()
        detectable = threshold * floor
        # The injected leak as this test measures it: the coefficient it adds on top of the first assembly's.
        injected_coefficient = coefficients[j, n_ds + i].item() - coefficients[j, 0].item()
        unpowered = power_shortfall(injected_coefficient, floor, detectable)
        for v in range(n_ds):
            coefficient = coefficients[j, v].item()
            yield (
                v,
                i,
                dict(
                    testable=True,
                    coefficient=coefficient,
                    noise_floor=floor,
                    detectable_coefficient=detectable,
                    statistic=_statistic(coefficient, detectable),
                    leak_seen=abs(coefficient) > detectable,
                    injected_leak_coefficient=injected_coefficient,
                    injected_leak_over_floor=injected_coefficient / floor if floor > 0 else math.inf,
                    powered=unpowered is None,
                    power_shortfall=unpowered,
                ),
            )


def _term_entries(names, fit, sums: _Sums, n_ds: int, threshold: float, tolerance: float) -> list[dict[str, dict]]:
    out = [{n: dict(e) for n, e in fit[0].items()} for _ in range(n_ds)]
    for v, i, entry in _fitted(names, fit, n_ds, threshold):
        grad_norm, detectable = math.sqrt(sums.plain[i].item()), entry["detectable_coefficient"]
        out[v][names[i]] = dict(
            entry,
            reason=None,
            grad_norm=grad_norm,
            norm_rule_detectable_coefficient=tolerance / grad_norm,
            margin_at_recipe_gamma=RECIPE_GAMMA / detectable if detectable > 0 else math.inf,
        )
    return out


def _block_entries(names, fit, sums: _Sums, total: _Sums, n_ds: int, threshold: float) -> list[dict[str, dict]]:
    """One block's entries per difference: each term's share of its squared norm in the block, and the fit there."""
    shares = {n: (sums.plain[i] / total.plain[i]).item() if total.plain[i] > 0 else 0.0 for i, n in enumerate(names)}
    out = [
        {n: {**e, "share": shares.get(n, 0.0)} for n, e in fit[0].items() if e["reason"] != NO_GRAPH}
        for _ in range(n_ds)
    ]
    for v, i, entry in _fitted(names, fit, n_ds, threshold):
        out[v][names[i]] = dict(entry, share=shares[names[i]])
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


def blocks_powered(blocks: dict[str, dict[str, dict]]) -> bool:
    """Every (block, term) holding at least ``BLOCK_SHARE`` of the term's squared norm is testable and powered: an
    injected ``RECIPE_GAMMA`` leak measures ``POWER_MARGIN`` of the block's floors there (``power_shortfall``)."""
    large = [e for leaks in blocks.values() for e in leaks.values() if e["share"] >= BLOCK_SHARE]
    return all(e["testable"] and e["powered"] for e in large)


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


def block_leaks(blocks: dict[str, dict[str, dict]]) -> list[str]:
    """``"<term> in <block>"`` for every block fit that sees a leak."""
    return [f"{term} in {block}" for block, leaks in blocks.items() for term, e in leaks.items() if e.get("leak_seen")]


def block_summary(blocks: dict[str, dict[str, dict]]) -> dict[str, float | str | None]:
    """The largest block statistic, and the weakest block: the largest detectable coefficient of any tested (block,
    term), with its share of the term's squared norm."""
    tested = [(b, t, e) for b, leaks in blocks.items() for t, e in leaks.items() if e["testable"]]
    if not tested:
        return dict(block_statistic=None, weakest_block=None, weakest_block_detectable=None, weakest_block_share=None)
    block, term, weakest = max(tested, key=lambda x: x[2]["detectable_coefficient"])
    return dict(
        block_statistic=max(e["statistic"] for _, _, e in tested),
        weakest_block=f"{term} in {block}",
        weakest_block_detectable=weakest["detectable_coefficient"],
        weakest_block_share=weakest["share"],
    )
