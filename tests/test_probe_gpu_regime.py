"""The probe a GPU user can trust (issue 32): false alarms at the stated rate, leaks confined to one block caught.

Fast tier: the Student-t threshold against scipy, its "at most" claim by simulation, the blocks of PEFT parameter
names, and the block test on synthetic gradients. Model tier: the emulated GPU regime on the testbed policy (real
gradients measured once, fresh synthetic correlated roundoff on every pass: ``verification.gpu_regime``), 1,100
clean evaluations and the power left at gamma 0.02. Slow: a leak confined to a 1% block of the wide tiny model.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from scipy import stats

from papo_nb.papo.probe.blocks import block_name, parameter_blocks
from papo_nb.papo.probe.projection import BLOCK_SHARE, RECIPE_GAMMA, leak_tests
from papo_nb.papo.probe.threshold import (
    FALSE_ALARM_RATE,
    detection_threshold,
    student_t_quantile,
    student_t_two_sided_tail,
)

CLEAN_BATCHES = 5  # x 2 precisions x EVALUATIONS_PER_BATCH = 1,100 clean evaluations
EVALUATIONS_PER_BATCH = 110


@pytest.mark.parametrize("dof", [1, 2, 3, 4, 7, 8, 16])
def test_the_threshold_is_the_student_t_quantile(dof):
    for tail in (0.3, 1e-3, 2.9e-5):
        assert student_t_quantile(tail, dof) == pytest.approx(stats.t.isf(tail / 2, dof), rel=1e-9)
    for t in (0.0, 0.5, 3.0, 40.0):
        assert student_t_two_sided_tail(t, dof) == pytest.approx(2 * stats.t.sf(t, dof), rel=1e-9, abs=1e-15)
    assert detection_threshold(dof, 10) == pytest.approx(stats.t.isf(FALSE_ALARM_RATE / 20, dof), rel=1e-9)
    with pytest.raises(ValueError, match="dof=2.5"):
        student_t_two_sided_tail(1.0, 2.5)


@pytest.mark.parametrize("samples", [2, 8])
def test_the_false_alarm_rate_is_at_most_the_nominal_one_with_the_floor_the_probe_estimates(samples):
    """The probe's statistic: the tested difference and every sample share the parent pass (``d = e_z - e_p``,
    ``s_i = e_i - e_p``), the floor is the root mean square of the samples. Gaussian roundoff, 400,000 draws."""
    e = torch.randn(400_000, samples + 2, generator=torch.Generator().manual_seed(samples), dtype=torch.float64)
    d, s = e[:, 1] - e[:, 0], e[:, 2:] - e[:, :1]
    statistic = d.abs() / s.pow(2).mean(-1).sqrt()
    for rate in (1e-1, 1e-2, 1e-3):
        observed = (statistic > student_t_quantile(rate, samples)).double().mean().item()
        assert observed <= rate + 3 * math.sqrt(rate / 400_000), (rate, observed)
    # and the 6-floor rule it replaces was far above 1e-3 with 2 samples (the 2.7% per term)
    if samples == 2:
        assert (statistic > 6).double().mean().item() > 10 * FALSE_ALARM_RATE


def test_blocks_are_named_parameter_groups_without_peft_wrappers():
    lora = "base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_{}.default.weight"
    assert (
        block_name(lora.format("A"))
        == block_name(lora.format("B"))
        == "model.language_model.layers.3.self_attn.q_proj"
    )
    assert block_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head"
    assert block_name("base_model.model.model.visual.merger.mlp.0.base_layer.bias") == "model.visual.merger.mlp.0"
    blocks = parameter_blocks([(lora.format("A"), 8), (lora.format("B"), 4), ("lm_head.weight", 3), ("x.bias", 0)])
    assert blocks.names == ("model.language_model.layers.3.self_attn.q_proj", "lm_head", "x")
    assert blocks.segments == ((0, 12, 0), (12, 15, 1), (15, 15, 2)) and blocks.size == 15


def synthetic_blocks(n_blocks=60, width=200, seed=0):
    """A parent gradient, two terms spread over ``n_blocks`` blocks with uneven shares, and small roundoff."""
    g = torch.Generator().manual_seed(seed)
    n = n_blocks * width
    scale = torch.linspace(0.2, 2.0, n_blocks, dtype=torch.float64).repeat_interleave(width)
    parent = torch.randn(n, generator=g, dtype=torch.float64)
    kl, entropy = (torch.randn(n, generator=g, dtype=torch.float64) * 0.05 * scale for _ in range(2))
    noise = [torch.randn(n, generator=g, dtype=torch.float64) * 2e-3 * parent.abs() for _ in range(9)]
    blocks = parameter_blocks((f"layers.{b}.q_proj.weight", width) for b in range(n_blocks))
    return parent, {"perception_kl": kl, "original_entropy": entropy, "masked_entropy": None}, noise, blocks


def test_a_leak_confined_to_a_one_percent_block_is_caught_by_the_block_test_alone():
    parent, grads, (tested, *samples), blocks = synthetic_blocks()
    kl = grads["perception_kl"]
    shares = torch.stack([kl[a:b].pow(2).sum() for a, b, _ in blocks.segments]) / kl.pow(2).sum()
    small = int(torch.argmin((shares - BLOCK_SHARE).abs()))  # the block nearest to a 1% share
    start, stop, _ = blocks.segments[small]
    leak = torch.zeros_like(kl)
    leak[start:stop] = RECIPE_GAMMA * kl[start:stop]
    injected = {n: tested + RECIPE_GAMMA * grads[n] for n in ("perception_kl", "original_entropy")}
    result = leak_tests(
        [tested, tested + leak], injected, parent, samples, parent**2, grads, 0.05, lambda t: t, blocks
    )
    assert result.tests == 2 + 2 * 60 and result.samples == 8
    assert result.threshold == pytest.approx(detection_threshold(8, 122))
    clean_terms, leaky_terms = result.terms
    clean_blocks, leaky_blocks = result.blocks
    name = blocks.names[small]
    assert leaky_blocks[name]["perception_kl"]["share"] == pytest.approx(shares[small].item())
    assert 0.005 < shares[small] < 0.02
    assert leaky_blocks[name]["perception_kl"]["leak_seen"], "the block's own fit sees 0.02"
    assert leaky_blocks[name]["perception_kl"]["coefficient"] == pytest.approx(RECIPE_GAMMA, rel=0.05)
    assert not leaky_terms["perception_kl"]["leak_seen"], "the whole-gradient fit sees only share x 0.02"
    assert not any(e["leak_seen"] for leaks in clean_blocks.values() for e in leaks.values())
    assert not any(e.get("leak_seen") for e in clean_terms.values())


# ---- the emulated GPU regime on the testbed policy (model tier) ----


@pytest.fixture(scope="module")
def cached_testbed(testbed_path, tmp_path_factory):
    from test_probe_power import make_testbed_trainer, rollouts

    from papo_nb.workbook.verification.gpu_regime import cache_batch

    trainer = make_testbed_trainer(testbed_path, tmp_path_factory.mktemp("gpu_regime"))
    batches = rollouts(trainer, CLEAN_BATCHES, seed=400)
    return [cache_batch(trainer, b, p, f"phase1/{p}") for b in batches for p in ("fp32", "bf16")]


@pytest.mark.model
def test_a_thousand_clean_evaluations_in_the_emulated_gpu_regime_stay_within_the_stated_rate(cached_testbed):
    from papo_nb.workbook.verification.gpu_regime import REGIMES, PassNoise, evaluate, false_alarm_table

    generator = torch.Generator().manual_seed(32)
    evaluations = [
        evaluate(c, PassNoise(c, REGIMES[c.precision], generator))
        for c in cached_testbed
        for _ in range(EVALUATIONS_PER_BATCH)
    ]
    table = false_alarm_table(evaluations)
    print("\n" + "\n".join(str(row) for row in table))
    n = len(evaluations)
    assert n >= 1000
    # at most 1e-3 per evaluation: 1.1 expected at the bound; more than 4 has probability 0.5% there
    assert sum(e["failed"] for e in evaluations) <= 4
    # the rate holds at every level, not only at 1e-3: the fraction of evaluations that would alarm at a budget of
    # 5% (or 20%) is at most that budget (3 binomial standard errors)
    for rate in (0.05, 0.2):
        observed = sum(e["p_value"] <= rate for e in evaluations) / n
        assert observed <= rate + 3 * math.sqrt(rate * (1 - rate) / n), (rate, observed)
    bf16 = [e for e in evaluations if e["label"].endswith("bf16")]
    # staged repeats: 2, and 8 where bf16 roundoff leaves 2 unpowered
    assert {e["samples"] for e in evaluations} <= {2, 8} and any(e["samples"] == 8 for e in bf16)
    assert sum(e["powered"] for e in bf16) > 0 and sum(e["powered"] for e in evaluations) > n / 3
    # the regime is the one that hurt: the old rule (6 floors, 2 repeats) false-alarms here
    assert sum(e["old_rule_floors"] > 6 for e in bf16) > 0


@pytest.mark.model
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_recipe_gamma_leak_of_each_term_fails_every_powered_emulated_evaluation(cached_testbed, precision):
    """The real injected 0.02 leak of each term (measured through the backward, rounded as bf16 rounds it) added to
    the zero-gamma pass: the probe fails it, or it is unpowered (deferred), never passed."""
    from papo_nb.workbook.verification.gpu_regime import REGIMES, PassNoise, evaluate

    generator = torch.Generator().manual_seed(33)
    for term in ("perception_kl", "original_entropy"):
        outcomes = []
        for c in (c for c in cached_testbed if c.precision == precision):
            noise = PassNoise(c, REGIMES[precision], generator)
            outcomes += [evaluate(c, noise, leak=c.gradients.injected[term]) for _ in range(10)]
        caught = [e for e in outcomes if e["failed"]]
        passed = [e for e in outcomes if not e["failed"] and e["powered"]]
        print(f"\n{precision} {term}: caught {len(caught)} of {len(outcomes)}")
        assert not passed, f"a powered evaluation passed a {RECIPE_GAMMA} leak of {term}"
        assert len(caught) >= len(outcomes) / 4


# ---- a leak in one block of the wide tiny model (16 LoRA layers) ----


@pytest.fixture(scope="module")
def cached_wide(tmp_path_factory):
    from test_probe_power import ROOT, rollouts

    from papo_nb.testbed.models import build_tiny_vlm
    from papo_nb.workbook.config.params import WorkbookParams, load_params
    from papo_nb.workbook.training.builder import prepare_training
    from papo_nb.workbook.verification.gpu_regime import cache_batch

    folder = tmp_path_factory.mktemp("wide")
    path = build_tiny_vlm("qwen2_vl", seed=0, cache_dir=folder / "cache", size="wide")
    raw = load_params(ROOT / "params" / "calibration_testbed.yaml").model_dump()
    fields = {k: v for k, v in raw.items() if k in WorkbookParams.model_fields}
    params = WorkbookParams(**{**fields, "model_name_or_path": str(path), "dataset": "synthetic"})
    trainer, _, _ = prepare_training(params, Path(folder) / "run", save_strategy="no")
    (batch,) = rollouts(trainer, 1, seed=300)
    return [cache_batch(trainer, batch, p, f"wide/{p}") for p in ("fp32", "bf16")]


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_leak_confined_to_a_one_percent_block_of_the_wide_model_fails(cached_wide, precision):
    from papo_nb.workbook.verification.gpu_regime import REGIMES, PassNoise, block_shares, confined_leak, evaluate

    (cached,) = [c for c in cached_wide if c.precision == precision]
    assert len(cached.gradients.blocks.names) == 16
    noise = PassNoise(cached, REGIMES[precision], torch.Generator().manual_seed(34))
    clean = [evaluate(cached, noise) for _ in range(8)]
    assert not any(e["failed"] for e in clean), "a clean evaluation alarmed"
    # Power is drawn per evaluation (its floor comes from its own roundoff samples), not fixed by the batch: in bf16
    # the weakest block's injected leak measures a median 32 of its floors on an AVX2 CPU's avx2 path and 23.5 on its
    # default path against the margin of 20 (docs/probe_power.md), so some clean evaluations fall short and are
    # deferred, never passed. With this generator: 8 of 8 powered on an AVX2 CPU's avx2 path, 6 of 8 on its default
    # path, 2 of 8 on an AVX-512 Xeon's avx2 path (the same at 1f60324: the CPU's BLAS, not the adapter, moves the
    # floors). Each powered evaluation must pass; in bf16 at least one must be powered, in fp32 half, as before.
    powered = sum(e["powered"] and e["blocks_powered"] for e in clean)
    print(f"\n{precision}: {powered} of {len(clean)} clean evaluations powered")
    assert powered >= (len(clean) / 2 if precision == "fp32" else 1)
    for term in ("perception_kl", "original_entropy"):
        shares = block_shares(cached, term)
        block = min((b for b, s in shares.items() if s >= BLOCK_SHARE), key=shares.get)  # the smallest >= 1%
        leaky = [evaluate(cached, noise, leak=confined_leak(cached, term, block)) for _ in range(4)]
        entry = leaky[0]["blocks"][block][term]
        weakest = max(
            e["detectable_coefficient"] for ls in leaky[0]["blocks"].values() for e in ls.values() if e["testable"]
        )
        print(
            f"\n{precision} {term} in {block} ({shares[block]:.2%}): coefficient {entry['coefficient']:.3g}, "
            f"floor {entry['noise_floor']:.2e}, detectable {entry['detectable_coefficient']:.2e}; weakest block "
            f"detectable {weakest:.2e}"
        )
        assert shares[block] < 0.05
        assert all(f"{term} in {block}" in e["seen"] for e in leaky), "the block test sees the confined leak"
        # The whole-gradient fit sees only share x 0.02 of a confined leak. At bf16 floors that lies below what the
        # whole fit can detect (measured 2.6-15x below on the default, avx2 and avx512 paths), so the block test is
        # what catches it. Whether the whole fit crosses its threshold anyway on one evaluation is chance (once in 8
        # on the default path), so this holds its power, not a miss.
        effective = shares[block] * RECIPE_GAMMA
        if precision == "bf16":
            detectable = [e["detectable"][term] for e in leaky]
            assert min(detectable) > effective, f"the whole fit is powered for {effective:.2e}: {detectable}"
