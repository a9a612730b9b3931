"""The masked branch's timing (issue 22): once per generation round (``masked_branch="rollout"``, the official one)
or in every loss call (``"update"``), inside real ``trainer.train()`` loops on the tiny Qwen2-VL; and the skip of an
optimizer step whose gradient norm is not finite."""

import math
import re

import pytest
import torch
from peft import get_peft_model
from tiny_trainers import tiny_trainer, unit_params
from transformers import TrainerCallback
from trl import GRPOTrainer

from papo_nb.papo import PAPOGTrainer, rollout_branch
from papo_nb.papo import prefill as shared_prefix
from papo_nb.papo.step_guard import NonFiniteGradientError
from papo_nb.prefix_sharing import attention_cost, trl_seams
from papo_nb.testbed.models import load_vlm
from papo_nb.workbook.rollouts import clone_batch, rollout_batch
from papo_nb.workbook.training.builder import lora_config

pytestmark = pytest.mark.model  # every test here builds and runs a VLM

G = 4
FP32_TOL = 1e-5


def fresh_policy(tiny_vlm_path):
    """The tiny model with the same fresh LoRA adapter every call (each training run needs its own weights)."""
    model, processor = load_vlm(str(tiny_vlm_path))
    torch.manual_seed(0)
    return get_peft_model(model, lora_config(unit_params())), processor


def trainer_on(tiny_vlm_path, dataset, folder, **overrides):
    model, processor = fresh_policy(tiny_vlm_path)
    settings = dict(num_generations=G, per_device_train_batch_size=G, logging_steps=1, report_to="none")
    return tiny_trainer(model, processor, dataset, folder, **{**settings, **overrides})


def logged(trainer, key):
    return [row[key] for row in trainer.state.log_history if key in row]


def trainable_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def test_the_round_carries_the_masked_branch_and_both_timings_agree_on_it(tiny_vlm_path, shapes_dataset, tmp_path):
    """The rollout pass stores (rows x completion tokens) log-probs with the round; the loss from them equals the
    loss and gradient of the update path (same policy, same masks) to fp32 tolerance, shared prefix or full."""
    for masked_forward in ("auto", "full"):
        rollout = trainer_on(
            tiny_vlm_path, shapes_dataset, tmp_path / f"r_{masked_forward}", masked_forward=masked_forward
        )
        batch = rollout_batch(rollout, shapes_dataset, n_prompts=2, seed=0)
        stored = batch[rollout_branch.MASKED_LOGPS_KEY]
        assert stored.shape == batch["completion_ids"].shape and not stored.requires_grad
        assert rollout.masked_branch.stored(batch) is not None
        # the shared prefix runs under "auto" where the installed TRL's log-prob form allows it (not 1.16's fused one)
        shared = masked_forward == "auto" and trl_seams.prefill_reason() is None
        assert rollout._metrics["train"][shared_prefix.METRIC] == [1.0 if shared else 0.0]
        if shared:
            assert rollout._metrics["train"][shared_prefix.SHARE_METRIC] == [G]
        update = tiny_trainer(
            rollout.model,
            rollout.processing_class,
            shapes_dataset,
            tmp_path / f"u_{masked_forward}",
            num_generations=G,
            per_device_train_batch_size=2 * G,
            masked_branch="update",
            masked_forward=masked_forward,
        )
        assert update.masked_branch.stored(batch) is None, "another trainer's branch is not reused"
        before = rollout.masked_branch.clock.seconds
        losses, grads = [], []
        for trainer in (rollout, update):
            trainer.current_gradient_accumulation_steps = 1
            loss = trainer._compute_loss(trainer.model, batch)
            losses.append(loss.detach())
            grads.append(trainable_grads(trainer.model, loss))
        assert rollout.masked_branch.clock.seconds == before, (
            "the rollout trainer must not recompute the masked branch"
        )
        assert update.masked_branch.clock.seconds > 0
        assert torch.allclose(losses[0], losses[1], atol=FP32_TOL, rtol=0), (losses, masked_forward)
        assert (grads[0] - grads[1]).norm() <= FP32_TOL * grads[1].norm(), masked_forward
        assert grads[1].norm() > 0


def test_one_step_per_round_trains_identically_with_both_timings(tiny_vlm_path, shapes_dataset, tmp_path):
    """Real train() loops, one optimizer step per round, one iteration: the same losses, KLs and gradient norms."""
    runs = {}
    for timing in ("rollout", "update"):
        trainer = trainer_on(tiny_vlm_path, shapes_dataset, tmp_path / timing, masked_branch=timing, max_steps=3)
        trainer.train()
        runs[timing] = {key: logged(trainer, key) for key in ("loss", "perception_kl", "grad_norm")}
    for key, values in runs["rollout"].items():
        assert len(values) == 3 and all(math.isfinite(v) for v in values), key
        assert values == pytest.approx(runs["update"][key], rel=1e-4, abs=1e-6), key
    assert min(runs["rollout"]["perception_kl"]) > 0


def train_one_round(tiny_vlm_path, shapes_dataset, folder, timing, **overrides):
    """A trainer with the masked branch at ``timing``, trained for one round of 3 optimizer steps."""
    trainer = trainer_on(
        tiny_vlm_path, shapes_dataset, folder / timing, masked_branch=timing, steps_per_generation=3, max_steps=3,
        **overrides,
    )  # fmt: skip
    trainer.train()
    return trainer


def test_three_steps_per_round_serve_every_completion_of_a_prompt_with_one_prefill(
    tiny_vlm_path, shapes_dataset, tmp_path
):
    """With 3 optimizer steps per round the rollout pass sees each prompt's G rollouts before TRL's shuffle: the
    logged completions per prefill equal G; the update path, after the shuffle, gets far fewer."""
    shares = {}
    for timing in ("rollout", "update"):
        # TRL's row shuffle (prefix sharing would shuffle whole groups, and each device batch hold G of a prompt)
        trainer = train_one_round(tiny_vlm_path, shapes_dataset, tmp_path, timing, per_device_train_batch_size=2 * G,
                                  prefix_sharing=False)  # fmt: skip
        shares[timing] = logged(trainer, shared_prefix.SHARE_METRIC)
        assert logged(trainer, shared_prefix.METRIC), timing
    assert shares["rollout"] == [G] * len(shares["rollout"]) and shares["rollout"]
    assert max(shares["update"]) < G, shares


def test_several_steps_per_round_differ_only_by_the_staleness(tiny_vlm_path, shapes_dataset, tmp_path):
    """mask_ratio 1.0 makes the mask independent of the draw, so the timings differ only in which policy computed
    the masked branch: step 1 of a round agrees, steps 2 and 3 (rollout: the rollout-time target) differ."""
    kls = {}
    for timing in ("rollout", "update"):
        trainer = train_one_round(tiny_vlm_path, shapes_dataset, tmp_path, timing, mask_ratio=1.0, learning_rate=5e-2)
        kls[timing] = logged(trainer, "perception_kl")
    assert kls["rollout"][0] == pytest.approx(kls["update"][0], rel=1e-4)
    staleness = [abs(a - b) / b for a, b in zip(kls["rollout"][1:], kls["update"][1:], strict=True)]
    print(f"\nperception KL per step, rollout {kls['rollout']}, update {kls['update']}; relative gap {staleness}")
    assert max(staleness) > 1e-4, "a moved policy must see a different masked target in steps 2-3"


@pytest.mark.parametrize("timing", ["rollout", "update"])
def test_iterations_and_accumulation_compute_the_masked_branch_as_the_timing_says(
    tiny_vlm_path, shapes_dataset, tmp_path, timing
):
    """num_iterations 2 and 2 accumulation steps: rollout computes the branch once per round (1 metric value per
    round), update in every loss call; both train with finite losses."""
    trainer = trainer_on(
        tiny_vlm_path,
        shapes_dataset,
        tmp_path / timing,
        masked_branch=timing,
        num_iterations=2,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        max_steps=2,
    )
    trainer.train()
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    loss_calls = 2 * 2  # optimizer steps x accumulation steps
    rounds = loss_calls // (2 * 2)  # each round serves steps_per_generation x num_iterations loss calls
    expected = rounds if timing == "rollout" else loss_calls
    # the shared/full metric is recorded where the branch runs: once per round, or in every loss call
    assert len(logged(trainer, shared_prefix.METRIC)) == (1 if timing == "rollout" else 2)
    assert trainer.masked_branch.clock.calls == expected, (timing, trainer.masked_branch.clock.calls)


def test_a_round_batch_without_its_masked_branch_is_refused(tiny_vlm_path, shapes_dataset, tmp_path):
    """A copy of a round's batch (not the object TRL buffered) that lost its branch is still this round's."""
    trainer = trainer_on(tiny_vlm_path, shapes_dataset, tmp_path / "t")
    batch = rollout_batch(trainer, shapes_dataset, n_prompts=1, seed=0)
    lost = {k: v for k, v in clone_batch(batch).items() if k != rollout_branch.MASKED_LOGPS_KEY}
    assert trainer._buffered_inputs is None, "nothing buffered: the round is known by its owner tag alone"
    with pytest.raises(RuntimeError, match="has images but no stored masked branch"):
        trainer._compute_loss(trainer.model, lost)


def test_the_per_row_check_catches_a_round_reordered_without_its_masked_branch(
    tiny_vlm_path, shapes_dataset, tmp_path
):
    """A TRL that shuffled only the keys it knows would hand each row another row's masked log-probs: one key
    shuffled, the rows it moved are named; the batch as stored passes."""
    trainer = trainer_on(tiny_vlm_path, shapes_dataset, tmp_path / "t")
    batch = rollout_batch(trainer, shapes_dataset, n_prompts=2, seed=0)
    trainer.papo_loss_parts(trainer.model, batch)
    assert trainer.masked_branch.clock.calls == 1, "the stored branch was used, not recomputed"
    order = torch.roll(torch.arange(len(batch["completion_ids"])), 1)
    shuffled = {**batch, "completion_ids": batch["completion_ids"][order]}
    moved = (rollout_branch.row_checks(shuffled) != batch[rollout_branch.ROW_CHECK_KEY]).nonzero().flatten()
    assert len(moved) > 0
    with pytest.raises(
        RuntimeError, match=re.escape(f"not aligned with the batch: rows {moved.tolist()} of {2 * G} carry")
    ):
        trainer.papo_loss_parts(trainer.model, shuffled)
    unchecked = {k: v for k, v in batch.items() if k != rollout_branch.ROW_CHECK_KEY}
    with pytest.raises(RuntimeError, match="has no per-row check"):
        trainer.papo_loss_parts(trainer.model, unchecked)


def count_forwards(model) -> list:
    """One entry per forward of the Hugging Face model under the LoRA wrapper (generation steps included)."""
    calls = []
    model.get_base_model().register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_gamma_zero_runs_no_masked_forward_and_costs_what_grpo_costs(tiny_vlm_path, shapes_dataset, tmp_path):
    """Issue 31: with the perception term off for the whole run (gamma 0, eta2 0, no probe) the masked branch is
    skipped: no mask drawn, no masked forward, so PAPOGTrainer makes exactly GRPOTrainer's forwards and losses;
    the KL is not logged (it was not measured). At the defaults the branch runs once per round, and at gamma 0 with
    ``measure_perception_kl`` too."""
    zero = dict(perception_loss_weight=0.0, original_entropy_weight=0.0, masked_entropy_weight=0.0)
    runs = {}
    for name, trainer_cls, overrides in (
        ("grpo", GRPOTrainer, {}),
        ("gamma0", PAPOGTrainer, zero),
        ("measured", PAPOGTrainer, {**zero, "measure_perception_kl": True}),
        ("papo", PAPOGTrainer, {}),
    ):
        model, processor = fresh_policy(tiny_vlm_path)
        settings = dict(
            num_generations=G, per_device_train_batch_size=G, logging_steps=1, report_to="none", max_steps=2
        )
        if trainer_cls is PAPOGTrainer:  # GRPOTrainer's forwards and losses exactly: TRL's own forward
            settings["prefix_sharing"] = False
        trainer = tiny_trainer(model, processor, shapes_dataset, tmp_path / name, trainer_cls, **settings, **overrides)
        calls = count_forwards(model)
        masks_before = trainer.masks.generator.get_state() if trainer_cls is PAPOGTrainer else None
        trainer.train()
        runs[name] = dict(trainer=trainer, forwards=len(calls), losses=logged(trainer, "loss"), masks=masks_before)
    grpo, gamma0, papo = runs["grpo"], runs["gamma0"], runs["papo"]
    print(f"\nforwards: GRPO {grpo['forwards']}, gamma 0 {gamma0['forwards']}, defaults {papo['forwards']}")
    assert gamma0["trainer"].masked_branch.skipped and gamma0["trainer"].masked_branch.clock.calls == 0
    assert gamma0["forwards"] == grpo["forwards"] and gamma0["losses"] == grpo["losses"]
    assert torch.equal(gamma0["trainer"].masks.generator.get_state(), gamma0["masks"]), "no mask was drawn"
    # nothing measured the masked branch: its terms are not logged, rather than logged as 0 (issue 45)
    assert logged(gamma0["trainer"], "perception_kl") == [] == logged(gamma0["trainer"], "masked_entropy")
    assert not papo["trainer"].masked_branch.skipped and papo["trainer"].masked_branch.clock.calls == 2
    assert papo["forwards"] > grpo["forwards"] and min(logged(papo["trainer"], "perception_kl")) > 0
    # asked to measure, gamma 0 runs the branch (a study's GRPO arm logs its KL) and still trains as GRPO does
    measured = runs["measured"]
    assert not measured["trainer"].masked_branch.skipped and measured["forwards"] == papo["forwards"]
    assert min(logged(measured["trainer"], "perception_kl")) > 0
    assert measured["losses"] == pytest.approx(grpo["losses"], abs=1e-6)


def test_text_only_round_stores_nothing_and_has_a_zero_perception_term(tiny_vlm_path, shapes_dataset, tmp_path):
    trainer = trainer_on(tiny_vlm_path, shapes_dataset, tmp_path / "t")
    batch = rollout_batch(trainer, shapes_dataset, n_prompts=1, seed=0)
    text_only = {
        k: v
        for k, v in batch.items()
        if k not in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
    }
    entries = trainer.masked_branch.rollout_entries(text_only, trainer.masked_pixel_values, trainer._with_entropy_grad)
    assert list(entries) == [rollout_branch.OWNER_KEY], "a text-only round stores only its owner tag"
    text_only["prompt_ids"], text_only["prompt_mask"] = (
        text_only["prompt_ids"][:, -4:],
        text_only["prompt_mask"][:, -4:],
    )
    trainer._buffered_inputs = [text_only]
    _, terms = trainer.papo_loss_parts(trainer.model, text_only)
    assert not terms.has_images and terms.kl_sum.item() == 0.0


def test_nonfinite_gradient_norm_skips_the_step_and_several_in_a_row_stop_the_run(
    tiny_vlm_path, shapes_dataset, tmp_path
):
    trainer = trainer_on(
        tiny_vlm_path, shapes_dataset, tmp_path / "t", max_steps=4, max_consecutive_nonfinite_grad_steps=2
    )
    lora = next(p for n, p in trainer.model.named_parameters() if p.requires_grad and "lora_B" in n)
    poison = {"steps": {1}}  # the optimizer step (0-based) whose gradient is NaN
    lora.register_hook(lambda g: g * float("nan") if trainer.state.global_step in poison["steps"] else g)
    weights = []

    class Watch(TrainerCallback):  # the weights after every optimizer step
        def on_step_end(self, args, state, control, **kwargs):
            weights.append(lora.detach().clone())

    trainer.add_callback(Watch())
    trainer.train()
    norms = logged(trainer, "grad_norm")
    assert math.isnan(norms[1]) and all(math.isfinite(n) for i, n in enumerate(norms) if i != 1), norms
    assert torch.equal(weights[1], weights[0]), "the skipped step must leave the weights as they were"
    assert not torch.equal(weights[2], weights[1]), "training goes on after one skip"
    assert trainer.step_guard.total == 1
    assert logged(trainer, "papo/nonfinite_grad_steps") == [1.0]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    again = trainer_on(
        tiny_vlm_path, shapes_dataset, tmp_path / "u", max_steps=4, max_consecutive_nonfinite_grad_steps=2
    )
    lora = next(p for n, p in again.model.named_parameters() if p.requires_grad and "lora_B" in n)
    lora.register_hook(lambda g: g * float("nan") if again.state.global_step >= 1 else g)
    with pytest.raises(NonFiniteGradientError, match=r"2 optimizer steps in a row .*\(1, nan\), \(2, nan\)"):
        again.train()


@pytest.mark.slow
def test_papo_nb_train_with_three_steps_per_round_logs_g_completions_per_prefill(tmp_path):
    """The issue's own reproduction, as a new user would run it: ``papo-nb train --params params/smoke.yaml -p
    steps_per_generation=3`` logged 1.22 completions per prefill with the masked branch in the loss; the rollout
    pass serves each prompt's G completions with one prefill."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mlflow import MlflowClient

    from papo_nb.infra.tracking import EXPERIMENT_NAME
    from papo_nb.workbook.config.params import load_params

    root = Path(__file__).resolve().parents[1]
    smoke = root / "params" / "smoke.yaml"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = ["steps_per_generation=3", "max_steps=3", "save_steps=3", "require_gpu_contract_probe=false"]
    command = [sys.executable, "-m", "papo_nb.cli", "train", "--params", str(smoke)]
    command += [a for o in overrides for a in ("-p", o)] + ["--output-dir", str(tmp_path / "run")]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id])
    shares = [m.value for m in client.get_metric_history(run.info.run_id, shared_prefix.SHARE_METRIC)]
    generations = load_params(smoke).num_generations
    print(f"\npapo-nb train, 3 steps per round: {shared_prefix.SHARE_METRIC} = {shares} (G = {generations})")
    assert shares and all(s == generations for s in shares), shares
    assert [m.value for m in client.get_metric_history(run.info.run_id, shared_prefix.METRIC)] == [1.0] * len(shares)


def test_in_loop_benchmark_reports_every_variant_and_ratio(tmp_path):
    """The in-loop benchmark end to end on the smallest shapes (well-formedness only: timings are not asserted)."""
    import json

    from papo_nb.bench import in_loop, in_loop_measure

    out = tmp_path / "in_loop.json"
    argv = ["--layouts", "G5_k3", "--repeats", "1", "--warmup", "0", "--image-px", "56", "--completion", "4"]
    argv += ["--prompts", "1", "--no-memory", "--cache-dir", str(tmp_path / "models"), "--out", str(out)]
    assert in_loop.main(argv) == 0
    (layout,) = json.loads(out.read_text())["layouts"]
    assert layout["G"] == 5 and layout["steps_per_round"] == 3 and layout["P"] >= 4 * layout["R"]
    for name in in_loop_measure.VARIANTS:
        assert layout[name]["no_sampling_cpu_s"] < layout[name]["total_cpu_s"], name
    assert layout["papo_rollout"]["share"] == 5.0 and layout["papo_update"]["share"] < 5.0
    assert layout["grpo"]["masked_cpu_s"] == 0.0 < layout["papo_rollout"]["masked_cpu_s"]
    for key in ("papo_rollout/grpo_no_sampling_cpu_s", "papo_update/grpo_total_s"):
        assert layout[key]["min"] <= layout[key]["median"] <= layout[key]["max"], key
    assert (
        layout["flop_bound"] == pytest.approx(in_loop_measure.flop_bound(layout["P"], layout["R"], 5), rel=1e-12)
        and 1.0 < layout["flop_bound"] < 2.0
    )
    widths = attention_cost.TextWidths(hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=64, layers=8)
    for name in in_loop_measure.VARIANTS:  # each variant's FLOP model ratio; prefix sharing below GRPO's step
        expected = in_loop_measure.flop_ratio(name, layout["P"], layout["R"], 5, 3)
        assert layout[name]["flop_ratio_tokens"] == pytest.approx(expected, rel=1e-12), name
        # the wide model's widths
        with_attention = in_loop_measure.flop_ratio(name, layout["P"], layout["R"], 5, 3, widths)
        assert layout[name]["flop_ratio"] == pytest.approx(with_attention, rel=1e-12), name
    assert layout["grpo_shared"]["flop_ratio"] < layout["papo_shared"]["flop_ratio"] < 1.0
    assert "papo_shared/grpo_no_sampling_cpu_s" in layout and "papo_shared/papo_rollout_no_sampling_cpu_s" in layout
    # TRL's default checkpointing on in the timed calls; the shared variants packed every log-prob call, the plain none
    assert layout["gradient_checkpointing"] is True
    assert layout["papo_shared"]["packed"] == layout["grpo_shared"]["packed"] == 1.0
    assert layout["papo_rollout"]["packed"] == 0.0 and layout["grpo"]["packed"] is None
