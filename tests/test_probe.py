"""The gamma-zero probe: passes on the real adapter, catches a leak, defers exactly the bound, fails on NaN."""

import dataclasses
import json

import pytest
import torch
from peft import get_peft_model
from tiny_trainers import tiny_trainer, unit_params

from papo_nb.papo import PAPOGTrainer
from papo_nb.papo.contract import GAMMA_ZERO_GRADIENT_ABS_FLOOR, GAMMA_ZERO_GRADIENT_REL_TOL, PAPO_ADAPTER_VERSION
from papo_nb.papo.probe import PASS_RULE, PROBE_CALLS, GammaZeroProbe, ProbeFailure, probe_batch, probe_batches
from papo_nb.testbed.models import load_vlm
from papo_nb.workbook.training.builder import lora_config
from papo_nb.workbook.verification.batches import rollout_batch


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
    assert evidence.separation_ratio == pytest.approx(evidence.perception_grad_norm / evidence.tolerance)
    assert evidence.leak_detection_power == evidence.separation_ratio and evidence.leak_detection_power >= 1
    record = json.loads(json.dumps(evidence.to_dict()))
    assert record["rule"] == PASS_RULE and record["adapter_version"] == PAPO_ADAPTER_VERSION
    assert record["trl_version"] == "1.9.1" and record["dtype"] == "float32" and record["autocast_enabled"] is False


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
    assert len(logged) == 1 and logged[0]["probe/passed"] == 1.0 and logged[0]["probe/separation_ratio"] > 1
    assert all(h["perception_kl"] > 0 for h in trainer.state.log_history if "perception_kl" in h)


@pytest.mark.model
def test_no_probe_code_runs_when_not_required(tiny_vlm_path, shapes_dataset, tmp_path):
    trainer, _ = build(tiny_vlm_path, shapes_dataset, tmp_path, require_gpu_contract_probe=False, max_steps=2)
    calls_before = dict(PROBE_CALLS)
    trainer.train()
    assert trainer.probe is None and calls_before == PROBE_CALLS
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
        assert evidence.leak_detection_power < 1 and not evidence.passed
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
    evidence = probe.observe(trainer, trainer.model, parent, _weakened(terms, 1e-6), assemble=leaky)
    assert evidence.grad_diff_norm > 0 and evidence.grad_diff_norm <= evidence.tolerance
    assert evidence.status == "underpowered"


@pytest.mark.model
def test_probe_batches_looks_at_the_next_batch(real):
    trainer, batch = real
    evidence = probe_batches(trainer, [batch, batch], max_degenerate_batches=5)
    assert evidence.passed and evidence.leak_detection_power >= 1


def test_calibration_power_names_the_weakest_point_and_flags_underpowered_ones():
    from papo_nb.workbook.verification.calibration import CalibrationPoint, plot_power, weakest_power

    points = [
        CalibrationPoint("phase1", "fp32", 0, 0.1, 0.0, 5e-3, 5e-2, 5e-2, 1e-2, True),
        CalibrationPoint("phase2", "bf16", 1, 0.1, 1e-5, 5e-3, 2e-3, 2e-3, 1e-2, True),
    ]
    assert points[1].leak_detection_power == pytest.approx(0.4)
    power = weakest_power(points)
    assert power["weakest_point"] == "phase2, bf16, batch 1" and power["underpowered_points"] == 1
    assert "UNDERPOWERED" in power["statement"] and "0.4" in power["statement"]
    (ax,) = plot_power(points).axes
    assert ax.get_yscale() == "log" and len(ax.patches) == 2 and "power" in ax.get_ylabel()


@pytest.mark.model
def test_underpowered_status_becomes_an_mlflow_tag(real, tmp_path):
    import mlflow

    from papo_nb.papo.probe import ProbeEvidence
    from papo_nb.workbook.training.run import tag_probe_status

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
