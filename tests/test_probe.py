"""The gamma-zero probe: passes on the real adapter, catches a leak, defers exactly the bound, fails on NaN."""

import dataclasses
import json
import math

import pytest
import torch
import trl
from peft import get_peft_model
from tiny_trainers import tiny_trainer, unit_params

from papo_nb.papo import PAPOGTrainer
from papo_nb.papo.contract import PAPO_ADAPTER_VERSION
from papo_nb.papo.probe import PASS_RULE, GammaZeroProbe, ProbeFailure, probe_batch, probe_batches
from papo_nb.papo.probe.contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL
from papo_nb.papo.probe.projection import NO_GRAPH, POWER_MARGIN, RECIPE_GAMMA, leak_assembly
from papo_nb.testbed.models import load_vlm
from papo_nb.workbook.rollouts import rollout_batch
from papo_nb.workbook.training.builder import lora_config


class LeakyPAPOGTrainer(PAPOGTrainer):
    """A broken adapter: the value is right at gamma = 0 but the perception gradient still flows."""

    @staticmethod
    def assemble_loss(parent_loss, terms, gamma, eta1, eta2):
        leak = terms.perception_kl - terms.perception_kl.detach()  # exactly 0.0 in value
        return PAPOGTrainer.assemble_loss(parent_loss, terms, gamma, eta1, eta2) + leak


def build(tiny_vlm_path, dataset, tmp_path, trainer_cls=PAPOGTrainer, zero_vision=False, **overrides):
    model, processor = load_vlm(str(tiny_vlm_path))
    if zero_vision:  # the vision tower then outputs zeros whatever the pixels: every batch is image-invariant
        with torch.no_grad():
            for p in model.model.visual.merger.parameters():
                p.zero_()
    torch.manual_seed(0)
    model = get_peft_model(model, lora_config(unit_params()))
    trainer = tiny_trainer(model, processor, dataset, tmp_path / "out", trainer_cls, **overrides)
    return trainer, rollout_batch(trainer, dataset, n_prompts=2, seed=0)


@pytest.fixture(scope="module")
def real(tiny_vlm_path, shapes_dataset, tmp_path_factory):
    return build(tiny_vlm_path, shapes_dataset, tmp_path_factory.mktemp("real"))


@pytest.mark.model
def test_probe_passes_on_the_real_adapter_with_full_evidence(real):
    trainer, batch = real
    evidence = probe_batch(trainer, batch)
    assert evidence.passed, evidence.message
    assert evidence.loss_bit_equal and evidence.parent_loss == evidence.zero_gamma_loss
    assert (
        evidence.grad_diff_norm
        <= evidence.tolerance
        == max(GAMMA_ZERO_GRADIENT_REL_TOL * evidence.parent_grad_norm, GAMMA_ZERO_GRADIENT_ABS_FLOOR)
    )
    assert evidence.perception_kl > 0 and evidence.perception_grad_norm > 0
    assert evidence.leak_detection_power == pytest.approx(evidence.perception_grad_norm / evidence.tolerance)
    assert not hasattr(evidence, "separation_ratio"), "the older alias is gone"
    # the projection test: every term with a graph is tested, the masked entropy (no-grad branch) is not
    leaks = evidence.term_leaks
    assert leaks["masked_entropy"] == dict(testable=False, reason=NO_GRAPH, grad_norm=0.0)
    for name in ("perception_kl", "original_entropy"):
        e = leaks[name]
        assert e["testable"] and not e["leak_seen"] and e["powered"], (name, e)
        assert e["coefficient"] == 0.0, "the CPU's two passes over one graph are bit-identical: no roundoff"
        assert 0 < e["detectable_coefficient"] <= RECIPE_GAMMA < e["norm_rule_detectable_coefficient"]
        assert e["injected_leak_coefficient"] == pytest.approx(RECIPE_GAMMA, rel=1e-3)
        assert e["injected_leak_over_floor"] >= POWER_MARGIN
    assert evidence.powered and evidence.roundoff_mode == "repeat" and evidence.roundoff_norm == 0.0
    record = json.loads(json.dumps(evidence.to_dict()))
    assert record["rule"] == PASS_RULE and record["adapter_version"] == PAPO_ADAPTER_VERSION
    assert record["trl_version"] == trl.__version__
    assert record["dtype"] == "float32" and record["autocast_enabled"] is False


@pytest.mark.model
def test_probe_passes_under_bf16_autocast(real):
    trainer, batch = real
    evidence = probe_batch(trainer, batch, autocast_dtype=torch.bfloat16)
    assert evidence.passed, evidence.message
    assert evidence.autocast_enabled and evidence.autocast_dtype == "bfloat16"


@pytest.mark.model
def test_probe_catches_a_leaking_adapter(tiny_vlm_path, shapes_dataset, tmp_path):
    trainer, batch = build(tiny_vlm_path, shapes_dataset, tmp_path, trainer_cls=LeakyPAPOGTrainer)
    with pytest.raises(ProbeFailure, match="perception gradient leaks through the gamma=0 path"):
        probe_batch(trainer, batch)


@pytest.mark.model
def test_image_invariant_model_fails_after_exactly_the_bound(tiny_vlm_path, shapes_dataset, tmp_path):
    bound = 20
    trainer, batch = build(
        tiny_vlm_path,
        shapes_dataset,
        tmp_path,
        zero_vision=True,
        require_gpu_contract_probe=True,
        probe_max_degenerate_batches=bound,
    )
    model = trainer.model
    for i in range(1, bound):
        trainer._compute_loss(model, batch)
        assert trainer.probe.pending and trainer.probe.degenerate_batches == i
        assert trainer.probe.evidence.status == "pending"
    with pytest.raises(ProbeFailure, match=f"{bound} consecutive image-invariant batches"):
        trainer._compute_loss(model, batch)
    assert trainer.probe.evidence.status == "failed" and trainer.probe.evidence.degenerate_batches_skipped == bound


@pytest.mark.model
def test_text_only_batches_do_not_count_as_degenerate(real):
    trainer, batch = real
    text_only = {
        k: v
        for k, v in batch.items()
        if k not in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
    }
    text_only["prompt_ids"], text_only["prompt_mask"] = batch["prompt_ids"][:, -4:], batch["prompt_mask"][:, -4:]
    probe = GammaZeroProbe(max_degenerate_batches=1)
    for _ in range(3):
        parent, terms = trainer.papo_loss_parts(trainer.model, text_only)
        evidence = probe.observe(trainer, trainer.model, parent, terms)
        assert evidence.status == "pending" and "no images" in evidence.message
    assert probe.batches_without_images == 3 and probe.degenerate_batches == 0
    parent, terms = trainer.papo_loss_parts(trainer.model, batch)
    assert probe.observe(trainer, trainer.model, parent, terms).passed


@pytest.mark.model
def test_non_finite_pieces_fail_at_once(real):
    trainer, batch = real
    parent, terms = trainer.papo_loss_parts(trainer.model, batch)
    poisoned = dataclasses.replace(terms, masked_entropy=terms.masked_entropy * float("nan"))
    assert torch.isnan(0.0 * poisoned.masked_entropy), "0.0 * nan is nan: the zero-gamma loss would be poisoned"
    probe = GammaZeroProbe()
    with pytest.raises(ProbeFailure, match="non-finite"):
        probe.observe(trainer, trainer.model, parent, poisoned)
    assert probe.evaluations == 1


@pytest.mark.model
def test_probe_runs_inside_training_and_logs_evidence(tiny_vlm_path, shapes_dataset, tmp_path):
    trainer, _ = build(tiny_vlm_path, shapes_dataset, tmp_path, require_gpu_contract_probe=True, max_steps=2)
    trainer.train()
    assert trainer.probe.evidence.passed and not trainer.probe.pending
    assert trainer.probe.evaluations == 1, "a passed probe stops running"
    logged = [h for h in trainer.state.log_history if "probe/passed" in h]
    assert len(logged) == 1 and logged[0]["probe/passed"] == 1.0 and logged[0]["probe/leak_detection_power"] > 0
    assert logged[0]["probe/projection/perception_kl/testable"] == 1.0
    assert 0 < logged[0]["probe/projection/perception_kl/detectable_coefficient"] <= RECIPE_GAMMA
    assert logged[0]["probe/projection/masked_entropy/testable"] == 0.0
    assert trainer.probe.measurements == 1
    assert all(h["perception_kl"] > 0 for h in trainer.state.log_history if "perception_kl" in h)


@pytest.mark.model
def test_no_probe_code_runs_when_not_required(tiny_vlm_path, shapes_dataset, tmp_path):
    from papo_nb.bench.timing import probe_calls

    trainer, _ = build(tiny_vlm_path, shapes_dataset, tmp_path, require_gpu_contract_probe=False, max_steps=2)
    trainer.train()
    assert trainer.probe is None and probe_calls(trainer.probe) == {"observe": 0, "measure": 0}
    assert not any(k.startswith("probe/") for h in trainer.state.log_history for k in h)


def _weakened(terms, factor):
    """The same batch with its perception term scaled down: KL stays > 0, its gradient drops below tolerance."""
    return dataclasses.replace(terms, perception_kl=terms.perception_kl * factor)


@pytest.mark.model
def test_underpowered_batches_are_deferred_then_end_underpowered_not_passed(real):
    trainer, batch = real
    probe = GammaZeroProbe(max_degenerate_batches=3)
    for i in (1, 2):
        parent, terms = trainer.papo_loss_parts(trainer.model, batch)
        evidence = probe.observe(trainer, trainer.model, parent, _weakened(terms, 1e-6))
        assert evidence.status == "pending" and "underpowered batch" in evidence.message
        assert not evidence.powered and not evidence.passed
        assert evidence.term_leaks["perception_kl"]["injected_leak_over_floor"] < POWER_MARGIN
        assert probe.underpowered_batches == i and probe.degenerate_batches == 0
    parent, terms = trainer.papo_loss_parts(trainer.model, batch)
    evidence = probe.observe(trainer, trainer.model, parent, _weakened(terms, 1e-6))
    assert evidence.status == "underpowered" and evidence.underpowered and not evidence.passed
    assert not probe.pending, "an underpowered verdict ends probing: the run goes on"
    assert evidence.to_dict()["underpowered"] and evidence.underpowered_batches_skipped == 3


@pytest.mark.model
def test_a_powered_batch_after_underpowered_ones_passes(real):
    trainer, batch = real
    probe = GammaZeroProbe(max_degenerate_batches=3)
    parent, terms = trainer.papo_loss_parts(trainer.model, batch)
    assert probe.observe(trainer, trainer.model, parent, _weakened(terms, 1e-6)).status == "pending"
    parent, terms = trainer.papo_loss_parts(trainer.model, batch)
    evidence = probe.observe(trainer, trainer.model, parent, terms)
    assert evidence.passed and evidence.underpowered_batches_skipped == 1


@pytest.mark.model
def test_a_leak_below_tolerance_is_reported_underpowered_never_passed(real):
    """The case the power exists for: a leak too small to see must not read as a pass."""
    trainer, batch = real

    def leaky(parent_loss, terms, gamma, eta1, eta2):
        return trainer.assemble_loss(parent_loss, terms, gamma, eta1, eta2) + (
            terms.perception_kl - terms.perception_kl.detach()
        )

    probe = GammaZeroProbe(max_degenerate_batches=1)
    parent, terms = trainer.papo_loss_parts(trainer.model, batch)
    # scaled down so far that the leak sits under the fp32 resolution of the parent gradient: neither test sees it
    evidence = probe.observe(trainer, trainer.model, parent, _weakened(terms, 1e-10), assemble=leaky)
    assert evidence.grad_diff_norm <= evidence.tolerance
    assert not evidence.term_leaks["perception_kl"]["leak_seen"]
    assert evidence.status == "underpowered"


@pytest.mark.model
def test_a_leak_the_norm_rule_cannot_see_fails_the_projection_test(real):
    """A value-neutral leak of 0.02 x perception KL: far under the norm rule's tolerance, caught by the projection."""
    trainer, batch = real
    evidence = probe_batch(
        trainer, batch, assemble=leak_assembly(trainer.assemble_loss, "perception_kl"), raise_on_failure=False
    )
    assert evidence.status == "failed" and "perception_kl leaks through the gamma=0 path" in evidence.message
    assert evidence.grad_diff_norm < evidence.tolerance, "the spec's norm rule alone would have passed it"
    assert evidence.term_leaks["perception_kl"]["coefficient"] == pytest.approx(RECIPE_GAMMA, rel=1e-3)


@pytest.mark.model
def test_probe_batches_looks_at_the_next_batch(real):
    trainer, batch = real
    image_keys = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
    text_only = {k: v for k, v in batch.items() if k not in image_keys}  # deferred: nothing to perceive
    text_only["prompt_ids"], text_only["prompt_mask"] = batch["prompt_ids"][:, -4:], batch["prompt_mask"][:, -4:]
    first = probe_batches(trainer, [text_only], max_degenerate_batches=5)
    assert first.status == "pending" and first.batches_without_images == 1
    evidence = probe_batches(trainer, [text_only, batch], max_degenerate_batches=5)
    assert evidence.passed and evidence.batches_without_images == 1 and evidence.leak_detection_power >= 1


@pytest.mark.model
def test_probe_roundoff_modes_are_checked_before_any_gradient(real):
    trainer, batch = real
    with pytest.raises(ValueError, match="roundoff='bogus' is not a roundoff mode; allowed: repeat, reordered"):
        GammaZeroProbe(roundoff="bogus")
    parent, terms = trainer.papo_loss_parts(trainer.model, batch)
    with pytest.raises(ValueError, match="pass the batch as inputs="):
        GammaZeroProbe(roundoff="reordered").observe(trainer, trainer.model, parent, terms)
    from papo_nb.papo.probe.roundoff import splits

    with pytest.raises(ValueError, match="at least 4 sequences to split, got 2"):
        splits(2)


@pytest.mark.model
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_the_reordered_split_adds_up_to_the_batch_gradient(tiny_vlm_path, shapes_dataset, tmp_path, loss_type):
    """Chunks weighted per loss_type are exact pieces of the batch loss: their gradients sum to the batch gradient up
    to fp32 roundoff (not exactly: that roundoff is what the calibration mode measures)."""
    from papo_nb.papo.probe.roundoff import accumulated_gradients, flat_grad, splits

    trainer, batch = build(tiny_vlm_path, shapes_dataset, tmp_path, loss_type=loss_type)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    parent, _ = trainer.papo_loss_parts(trainer.model, batch)
    g_parent = flat_grad(parent, params)
    tested, _ = splits(batch["completion_ids"].size(0))
    (g_split,), squares = accumulated_gradients(
        trainer, trainer.model, batch, params, [lambda p, t: p], tested, parent.item()
    )
    difference = torch.linalg.vector_norm(g_split - g_parent) / torch.linalg.vector_norm(g_parent)
    assert 0 < difference < 1e-5, difference.item()
    assert torch.all(squares >= 0) and squares.sum() > 0


@pytest.mark.model
def test_the_probe_in_calibration_mode_measures_real_roundoff_and_never_fails_clean(real):
    trainer, batch = real
    for dtype in (None, torch.bfloat16):
        evidence = probe_batch(trainer, batch, roundoff="reordered", autocast_dtype=dtype)
        assert evidence.roundoff_mode == "reordered" and evidence.roundoff_norm > 0 and evidence.grad_diff_norm > 0
        if dtype is None:
            assert evidence.passed, evidence.message
        else:  # bf16 roundoff on the tiny model can leave one batch underpowered (deferred): never a failure
            assert evidence.passed or "underpowered batch" in evidence.message, evidence.message


@pytest.mark.model
def test_underpowered_status_becomes_an_mlflow_tag(real, tmp_path):
    import mlflow

    from papo_nb.papo.probe import ProbeEvidence
    from papo_nb.train.records import tag_probe_status

    trainer, _ = real
    probe = GammaZeroProbe()
    probe.evidence = ProbeEvidence("underpowered", "probe UNDERPOWERED after 20 batches")
    trainer.probe, saved = probe, trainer.probe
    try:
        mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
        with mlflow.start_run() as run:
            assert tag_probe_status(trainer) == "underpowered"
        tags = mlflow.get_run(run.info.run_id).data.tags
    finally:
        trainer.probe = saved
    assert tags["papo_nb.probe_status"] == "underpowered" and "UNDERPOWERED" in tags["papo_nb.probe_warning"]


@pytest.mark.model
def test_probe_rollouts_starts_with_notebook_01s_batch(real, shapes_dataset):
    from papo_nb.workbook.verification.calibration import probe_rollouts

    trainer, batch = real  # built from rollout_batch(trainer, dataset, n_prompts=2, seed=0)
    evidence = probe_rollouts(trainer, shapes_dataset, seed=0)
    assert evidence.passed and evidence == probe_batch(trainer, batch)


def one_term_leaks(samples: list[torch.Tensor], injected_difference: torch.Tensor) -> dict:
    """``term_leaks`` on a six-element gradient: the perception term lives on element 0, the parent on 3-5, the
    batch's own difference is 0; ``injected_difference`` is what the injected leak left in the assembled gradient."""
    from papo_nb.papo.probe.projection import term_leaks

    g_parent = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    g_term = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    grads = {"perception_kl": g_term, "original_entropy": None, "masked_entropy": None}
    (leaks,) = term_leaks(
        [torch.zeros(6, dtype=torch.float64)],
        {"perception_kl": injected_difference},
        g_parent,
        samples,
        g_parent * g_parent,
        grads,
        1e-6,
        lambda t: t,
    )
    return leaks


def test_a_zero_floor_or_a_leak_that_rounds_away_never_powers_a_batch():
    from papo_nb.papo.probe.projection import describe, powered

    g_term = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    noise = [torch.tensor([s * 1e-6, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64) for s in (1.0, -1.0)]
    seen = one_term_leaks(noise, RECIPE_GAMMA * g_term)  # the control: roundoff measured, the leak seen
    assert seen["perception_kl"]["powered"] and seen["perception_kl"]["power_shortfall"] is None and powered(seen)

    # No roundoff where the term lives: the floor is exactly 0, so the seen leak "measures inf floors".
    zero_floor = one_term_leaks([torch.zeros(6, dtype=torch.float64)] * 2, RECIPE_GAMMA * g_term)["perception_kl"]
    assert zero_floor["noise_floor"] == 0.0 and zero_floor["injected_leak_over_floor"] == math.inf
    assert zero_floor["powered"] is False and "noise floor is exactly 0" in zero_floor["power_shortfall"]
    assert not powered({"perception_kl": zero_floor})

    # The injected leak left nothing in the assembled gradient (bf16 rounded it away): coefficient exactly 0.
    rounded = one_term_leaks(noise, torch.zeros(6, dtype=torch.float64))
    assert rounded["perception_kl"]["injected_leak_coefficient"] == 0.0 and not powered(rounded)
    assert "rounds away entirely" in rounded["perception_kl"]["power_shortfall"]
    assert "not powered: the injected" in describe(rounded)
