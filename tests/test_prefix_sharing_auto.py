"""``PAPOGConfig.prefix_sharing="auto"`` (the default, issue 55 item 6): on where supported, its first packed call
checked against the plain forward; a deliberately wrong layout (completions that see the ones before them) turns it
off for the run with one warning naming the difference, and the run goes on with the plain forward's log-probs; an
unsupported family or release is off with its reason and no warning; ``True`` there refuses (a warning, the plain
forward); ``False`` never packs."""

import collections
import copy
import dataclasses
import logging

import pytest
import torch
from test_prefix_sharing import (
    COMPLETIONS,
    PROMPTS,
    TEMPERATURE,
    PlainForwardWholeGroups,
    call_arguments,
    completion_mask,
    max_error,
    one_round,
    plain,
    prompt_parts,
)
from test_prefix_sharing_checkpointing import as_the_release_runs
from tiny_trainers import tiny_trainer

from papo_nb.papo import PAPOGConfig
from papo_nb.papo.forward_plan import forward_plan
from papo_nb.prefix_sharing import grouped_attention, self_check, trl_seams
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.testbed.models import build_tiny_vlm, load_vlm

LOGGER = "papo_nb.prefix_sharing.sharing"
RELEASE_REASON = trl_seams.packed_path_reason()  # None on every supported form (packed_head.py); else why it waits


def assert_off_for_the_release(trainer, model, arguments, caplog) -> None:
    """TRL 1.14+: "auto" is off with the release's reason in the plan, never builds a layout (``pack`` is refused
    here), never checks, never warns."""
    plan = trainer.forward_plan
    assert plan.log_prob_forward == "plain per completion", plan
    assert plan.log_prob_reason == f"prefix_sharing='auto' off: {RELEASE_REASON}", plan
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sharing = trainer.prefix_sharing
        assert sharing.compute(model, arguments, temperature=TEMPERATURE, entropy_grad=False, training=True) is None
    assert sharing.checked is None and not [r for r in caplog.records if r.levelno >= logging.WARNING]


# The default's plan (log-prob forward, the reason's first 40 characters) where the release packs, and where not
DEFAULT_PLAN = (
    ("packed per prompt group", "prefix_sharing='auto', supported here; g")
    if RELEASE_REASON is None
    else ("plain per completion", f"prefix_sharing='auto' off: {RELEASE_REASON}"[:40])
)


def leaking_pack(*args, **kwargs):
    """``packed_rows.pack`` with a wrong grouping: one segment for every completion of a group, so each completion
    attends to the ones packed before it."""
    batch = prefix_sharing_pack(*args, **kwargs)
    leaking = grouped_attention.build_layout(batch.token_groups, batch.segments[0].clamp(max=1))
    inputs = {**batch.model_inputs, "attention_mask": {"full_attention": leaking}}
    return dataclasses.replace(batch, model_inputs=inputs)


prefix_sharing_pack = prefix_sharing.pack


@pytest.fixture(scope="module")
def qwen25(shapes_dataset, tmp_path_factory):
    """A tiny Qwen2.5-VL (dropout 0), a trainer built with the default ``prefix_sharing`` on its own copy, and the
    adversarial batch of ``test_prefix_sharing.py`` (rows shuffled)."""
    folder = build_tiny_vlm("qwen2_5_vl", cache_dir=tmp_path_factory.mktemp("m"))
    model, processor = load_vlm(str(folder))
    model = as_the_release_runs(model.train())  # 1.15+: the fused LM head GRPOTrainer.__init__ installs
    prompts = [prompt_parts(processor, text, sizes, seed) for seed, (text, sizes) in enumerate(PROMPTS)]
    order = torch.randperm(len(COMPLETIONS), generator=torch.Generator().manual_seed(1)).tolist()
    return dict(folder=folder, model=model, processor=processor, dataset=shapes_dataset,
                arguments=call_arguments(processor, prompts, COMPLETIONS, order))  # fmt: skip


def auto_trainer(setup, out, **overrides):
    trainer_model, _ = load_vlm(str(setup["folder"]))
    trainer = tiny_trainer(trainer_model, setup["processor"], setup["dataset"], out, num_generations=3,
                           per_device_train_batch_size=9, **overrides)  # fmt: skip
    trainer.temperature = TEMPERATURE
    return trainer


def test_auto_is_the_default_and_the_only_new_value(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert PAPOGConfig(**common).prefix_sharing == "auto"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"PAPOGConfig.prefix_sharing=.* is invalid: expected one of \('auto', "):
            PAPOGConfig(**common, prefix_sharing=bad)
    # a device batch of part of a group: True is refused, "auto" is built and off, saying why
    split = dict(common, per_device_train_batch_size=6, num_generations=4, generation_batch_size=12)
    with pytest.raises(ValueError, match=r"prefix_sharing=True is invalid with per_device_train_batch_size=6"):
        PAPOGConfig(**split, prefix_sharing=True)
    assert "per_device_train_batch_size=6 is not a multiple of num_generations=4" in prefix_sharing.auto_batch_reason(
        PAPOGConfig(**split)
    )


@pytest.mark.model
def test_auto_on_a_supported_batch_packs_checks_its_first_call_and_says_so(qwen25, tmp_path, caplog):
    trainer, model, arguments = auto_trainer(qwen25, tmp_path / "t"), qwen25["model"], qwen25["arguments"]
    assert trainer.args.prefix_sharing == "auto"
    if RELEASE_REASON is not None:
        assert_off_for_the_release(trainer, model, arguments, caplog)
        return
    assert trainer.prefix_sharing.shuffles_whole_groups
    plan = trainer.forward_plan
    assert plan.log_prob_forward == "packed per prompt group", plan
    assert plan.log_prob_reason.startswith("prefix_sharing='auto', supported here; grouped attention through 'sdpa'")
    assert "its first packed batch is checked against the plain forward" in plan.log_prob_reason
    metrics = trainer._metrics["train"]
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=LOGGER):
        first = trainer._get_per_token_logps_and_entropies(model, **arguments)
        second = trainer._get_per_token_logps_and_entropies(model, **arguments)
        reference = plain(trainer, model, arguments)
    check = trainer.prefix_sharing.checked
    print(f"auto, first-batch check: {check.describe()}")
    assert check.passed and check.bound == self_check.LOGP_BOUNDS[torch.float32] and check.max_difference > 0
    assert max_error(first[0], reference[0], completion_mask(arguments)) == pytest.approx(check.max_difference)
    assert torch.equal(first[0], second[0]) and not torch.equal(first[0], reference[0]), "the packed numbers"
    assert metrics[prefix_sharing.METRIC] == [1.0, 1.0]
    assert "first packed batch matched the plain forward, max |packed - plain| log-prob" in (
        trainer.forward_plan.log_prob_reason
    )
    assert caplog.text.count("first packed batch matches the plain forward") == 1, "checked once"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.model
def test_a_wrong_layout_turns_auto_off_with_one_warning_and_the_plain_log_probs(qwen25, tmp_path, caplog, monkeypatch):
    trainer, model, arguments = auto_trainer(qwen25, tmp_path / "t"), qwen25["model"], qwen25["arguments"]
    if RELEASE_REASON is not None:
        monkeypatch.setattr(prefix_sharing, "pack", None)  # never called
        assert_off_for_the_release(trainer, model, arguments, caplog)
        return
    monkeypatch.setattr(prefix_sharing, "pack", leaking_pack)
    with torch.no_grad():
        reference = plain(trainer, model, arguments)
    metrics = trainer._metrics["train"]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with torch.no_grad():
            first = trainer._get_per_token_logps_and_entropies(model, **arguments)
        second = trainer._get_per_token_logps_and_entropies(model, **arguments)  # with gradient: the plain one's
    assert torch.equal(first[0], reference[0]) and torch.equal(second[0], reference[0])
    assert torch.equal(first[1], reference[1]) and second[0].grad_fn is not None
    check = trainer.prefix_sharing.checked
    assert not check.passed and check.max_difference > 100 * check.bound
    assert completion_mask(arguments)[check.row, check.token], "the place named is a completion token"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    print(warnings)
    assert len(warnings) == 1, warnings
    assert "prefix_sharing='auto' turned itself off for the run" in warnings[0]
    assert (
        f"max |packed - plain| log-prob {check.max_difference:.3g} at row {check.row}, completion token"
        in (warnings[0])
    )
    assert metrics[prefix_sharing.METRIC] == [0.0, 0.0]
    plan = trainer.forward_plan
    assert plan.log_prob_forward == "plain per completion" and "turned itself off" in plan.log_prob_reason, plan


@pytest.mark.model
@pytest.mark.slow
def test_a_run_whose_layout_is_wrong_trains_as_the_plain_forward(qwen25, tmp_path, caplog, monkeypatch):
    """Two optimizer steps (old and reference log-probs) with the wrong layout: the first packed call fails its
    check, every forward after it is the plain one, and the parameters are the plain forward's (same shuffle). On
    TRL 1.14+ nothing is packed or checked: the run is TRL's forward throughout, and equals it too."""
    monkeypatch.setattr(prefix_sharing, "pack", leaking_pack if RELEASE_REASON is None else None)
    folder = qwen25["folder"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run, start, after = one_round(folder, qwen25["dataset"], tmp_path / "auto", prefix_sharing="auto")
    _, _, expected = one_round(folder, qwen25["dataset"], tmp_path / "plain", PlainForwardWholeGroups)
    moved = max((after[n] - start[n]).abs().max().item() for n in start)
    diff = max((after[n] - expected[n]).abs().max().item() for n in start)
    print(f"wrong layout, auto: parameters moved {moved:.2e}, differ from the plain forward's by {diff:.2e}")
    assert moved > 1e-4 and diff == 0.0
    assert caplog.text.count("turned itself off for the run") == (RELEASE_REASON is None)
    flags = [h[prefix_sharing.METRIC] for h in run.state.log_history if prefix_sharing.METRIC in h]
    assert flags and all(flag == 0.0 for flag in flags)
    assert run.forward_plan.log_prob_forward == "plain per completion"


@pytest.mark.model
@pytest.mark.slow
def test_auto_under_bf16_mixed_precision_checks_at_the_precision_it_computed_in(qwen25, tmp_path):
    """A ``train()`` step under ``bf16=True`` (accelerate's autocast inside the wrapped forward): TRL's log-probs come
    back float32, but both forwards ran their matmuls in bf16, so the check holds them to bf16's bound and sharing
    stays on; the float32 bound (main before this test) turned it off on roundoff alone. The difference it found is
    above float32's bound, so the test would fail had the check used the log-probs' dtype."""
    if RELEASE_REASON is not None:
        pytest.skip(f"this release's packed path waits: {RELEASE_REASON}")
    run, _, _ = one_round(qwen25["folder"], qwen25["dataset"], tmp_path / "bf16", prefix_sharing="auto", bf16=True)
    check = run.prefix_sharing.checked
    print(f"bf16 mixed precision, first-batch check: {check.describe()}")
    assert check.bound == self_check.LOGP_BOUNDS[torch.bfloat16]
    assert check.passed and check.max_difference > self_check.LOGP_BOUNDS[torch.float32]
    flags = [h[prefix_sharing.METRIC] for h in run.state.log_history if prefix_sharing.METRIC in h]
    assert flags and all(flag == 1.0 for flag in flags)
    assert run.forward_plan.log_prob_forward == "packed per prompt group"


def text_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
    )  # fmt: skip


def test_auto_on_an_unsupported_family_is_off_with_its_reason_and_no_warning(tmp_path, caplog):
    model, metrics = text_model(), {"train": collections.defaultdict(list)}
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        auto = prefix_sharing.PrefixSharing(PAPOGConfig(**common), model, 1, metrics)
        for _ in range(3):
            assert auto.compute(model, {}, temperature=1.0, entropy_grad=False, training=True) is None
    reason = RELEASE_REASON or "model_type 'qwen2'"  # on TRL 1.14+ the release's reason comes first
    assert auto.reason.startswith(reason) and not auto.shuffles_whole_groups
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "no warning spam"
    assert caplog.text.count(f"prefix sharing (auto): plain forward per completion, because {reason}") == 1
    assert metrics["train"][prefix_sharing.METRIC] == [0.0] * 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        forced = prefix_sharing.PrefixSharing(PAPOGConfig(**common, prefix_sharing=True), model, 1, metrics)
        assert forced.compute(model, {}, temperature=1.0, entropy_grad=False, training=True) is None
    assert forced.reason == auto.reason and caplog.text.count(f"because {reason}") == 1, "True refuses"
    off = prefix_sharing.PrefixSharing(PAPOGConfig(**common, prefix_sharing=False), model, 1, metrics)
    assert not off.enabled and off.compute(model, {}, temperature=1.0, entropy_grad=False, training=True) is None


@pytest.mark.model
def test_auto_on_a_supported_family_it_cannot_run_here_says_why_in_the_plan(qwen25, tmp_path, caplog):
    """Qwen2.5-VL on two processes that split each device batch (or, on TRL 1.14+, this release): "auto" is off,
    the plan says so and why, no warning; True warns with the same reason."""
    trainer, model = auto_trainer(qwen25, tmp_path / "t"), qwen25["model"]
    split_args = copy.copy(trainer.args)
    split_args.accelerator_config = dataclasses.replace(trainer.args.accelerator_config, split_batches=True)
    metrics = {"train": collections.defaultdict(list)}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        auto = prefix_sharing.PrefixSharing(split_args, model, 2, metrics)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    reason = trl_seams.packed_path_reason() or (
        "accelerator_config.split_batches=True with 2 processes: each device batch is split across the processes, "
        "so a rank's rows are not whole prompt groups"
    )
    assert auto.reason == reason and not auto.shuffles_whole_groups
    plan = forward_plan(split_args, trainer.masked_branch, auto, model)
    assert plan.log_prob_forward == "plain per completion"
    assert plan.log_prob_reason == f"prefix_sharing='auto' off: {reason}", plan
    forced_args = copy.copy(split_args)
    forced_args.prefix_sharing = True
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        forced = prefix_sharing.PrefixSharing(forced_args, model, 2, metrics)
    assert forced.reason == reason and f"plain forward per completion, because {reason}" in caplog.text
    assert forward_plan(forced_args, trainer.masked_branch, forced, model).log_prob_reason == reason


@pytest.mark.model
def test_the_recipes_share_by_default_and_the_plan_says_so(qwen25, tmp_path):
    """Each official recipe (its batch one prompt's rollouts) on a tiny Qwen2.5-VL: sharing on by the default."""
    from papo_nb.papo import PAPOGTrainer, recipes

    for name in recipes.RECIPES:
        args = recipes.recipe_config(name, output_dir=str(tmp_path / name), use_cpu=True, bf16=False,
                                     max_completion_length=8, report_to="none")  # fmt: skip
        assert args.prefix_sharing == "auto"
        model, processor = load_vlm(str(qwen25["folder"]))
        trainer = PAPOGTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                               args=args, train_dataset=qwen25["dataset"], processing_class=processor)  # fmt: skip
        assert (trainer.forward_plan.log_prob_forward, trainer.forward_plan.log_prob_reason[:40]) == DEFAULT_PLAN, name


@pytest.mark.model
@pytest.mark.slow
def test_the_smoke_workbook_shares_by_default_and_its_run_records_the_plan(tmp_path):
    """``params/smoke.yaml``'s trainer packs by the default; ``papo-nb train --params params/smoke_fast.yaml`` (two
    steps) packs every log-prob call, its first checked, and the run's summary and MLflow tag say so."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mlflow import MlflowClient

    from papo_nb.infra.tracking import EXPERIMENT_NAME
    from papo_nb.train.records import FORWARD_PLAN_TAG
    from papo_nb.train.run_folder import SUMMARY_FILE
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.training.builder import prepare_training

    root = Path(__file__).resolve().parents[1]
    smoke = load_params(root / "params" / "smoke.yaml")
    assert smoke.prefix_sharing == "auto"
    trainer, _, _ = prepare_training(smoke, tmp_path / "smoke")
    assert (trainer.forward_plan.log_prob_forward, trainer.forward_plan.log_prob_reason[:40]) == DEFAULT_PLAN
    fast, out, uri = root / "params" / "smoke_fast.yaml", tmp_path / "run", f"sqlite:///{tmp_path}/mlflow.db"
    command = [sys.executable, "-m", "papo_nb.cli", "train", "--params", str(fast), "--output-dir", str(out)]
    command += ["-p", "max_steps=2", "-p", "save_steps=2"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plan = json.loads((out / SUMMARY_FILE).read_text())["forward_plan"]
    print(f"\nsmoke_fast forward plan: {plan}")
    assert (plan["log_prob_forward"], plan["log_prob_reason"][:40]) == DEFAULT_PLAN, plan
    assert ("first packed batch matched the plain forward" in plan["log_prob_reason"]) == (RELEASE_REASON is None)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id])
    assert run.data.tags[FORWARD_PLAN_TAG] == f"{plan['log_prob_forward']} ({plan['log_prob_reason']})"
    packed = [m.value for m in client.get_metric_history(run.info.run_id, prefix_sharing.METRIC)]
    assert (packed and set(packed) == {1.0}) if RELEASE_REASON is None else set(packed) <= {0.0}, packed
