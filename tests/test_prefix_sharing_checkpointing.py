"""Prefix sharing under gradient checkpointing (TRL's ``GRPOConfig`` turns it on by default, and ``Trainer.train``
enables it after the trainer is built): each checkpointed layer's recomputation runs inside the grouped layout, so
log-probs and every parameter's gradient equal the plain forward's under the same checkpointing (fp32 and fp64, the
adversarial batch of ``test_prefix_sharing.py``, transformers' checkpointing reentrant and not, torch's
``CheckpointWrapper``); a ``PAPOGTrainer`` with ``PAPOGConfig(prefix_sharing=True)`` and TRL's defaults trains and
its parameters after two SGD steps equal the plain forward's; a checkpointing the layout cannot follow runs the plain
forward, and the forward plan says why. On every supported TRL form the packed path runs (1.15+: through the fused
LM head, ``packed_head.py``); a form it did not reproduce would have the trainer test check that the forward plan
names TRL's forward and the release's reason."""

import copy
import inspect
import logging

import pytest
import torch
from peft import get_peft_model
from test_prefix_sharing import (
    FORCED_FORMS,
    TEMPERATURE,
    TOLERANCE,
    PlainForwardWholeGroups,
    assert_layout_form,
    completion_mask,
    gradients,
    in_dtype,
    max_error,
    reference_setup,
    worst_relative_error,
)
from tiny_trainers import tiny_trainer, unit_params
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from trl import GRPOTrainer

from papo_nb.papo import PAPOGConfig, PAPOGTrainer
from papo_nb.papo.forward_plan import forward_plan
from papo_nb.prefix_sharing import grouped_attention, trl_seams
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.testbed.models import build_tiny_vlm, load_vlm, vision_special_token_ids
from papo_nb.testbed.rewards import accuracy_reward, format_reward
from papo_nb.workbook.training.builder import lora_config

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# transformers' checkpointing as TRL's default turns it on (gradient_checkpointing_kwargs None: non-reentrant on
# transformers 5), reentrant, and torch's CheckpointWrapper around each decoder layer (FSDP's activation checkpointing)
CHECKPOINTING = ("trl_default", "reentrant", "torch_wrapper")
# parameters after two SGD steps in float64: packed against plain (max abs), and the least the steps must move them
PARAMETER_BOUND = 1e-9


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory, shapes_dataset):
    """The tiny model of the family (every parameter trainable), a trainer whose plain log-prob method is the
    reference, and the adversarial batch of ``test_prefix_sharing.py``, rows shuffled."""
    folder = build_tiny_vlm(request.param, cache_dir=tmp_path_factory.mktemp("m"))
    return dict(folder=folder, **reference_setup(folder, shapes_dataset, tmp_path_factory.mktemp("ckpt")))


def checkpointed(model, how: str):
    """``model`` with its decoder layers checkpointed ``how`` (``CHECKPOINTING``)."""
    if how == "torch_wrapper":
        layers = set(model.model.language_model.layers)
        apply_activation_checkpointing(model, check_fn=lambda module: module in layers)
        return model
    model.activation_checkpointing_enable({"use_reentrant": True} if how == "reentrant" else None)
    assert model.is_activation_checkpointing
    return model


def as_the_release_runs(model):
    """``model`` as ``GRPOTrainer.__init__`` sets the policy up on the installed TRL (1.15+: its fused LM head)."""
    if trl_seams.live_seam(GRPOTrainer) is trl_seams.FUSED:
        patch = getattr(inspect.getmodule(GRPOTrainer), trl_seams.FUSED_PATCH)  # the function __init__ calls
        patch(model, temperature=TEMPERATURE, outputs=trl_seams.FUSED_OUTPUTS)
    return model


@pytest.mark.model
@pytest.mark.parametrize("how", CHECKPOINTING)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("form", sorted(FORCED_FORMS))
def test_logps_and_gradients_equal_the_plain_forward_under_checkpointing(setup, monkeypatch, how, dtype, form):
    """The trainer's log-prob method with sharing on against TRL's, both under checkpointing: the packed path where
    the release runs it (TRL 1.9.1-1.13), TRL's own forward where it falls back (1.14+)."""
    monkeypatch.setattr(grouped_attention, "grouped_forms", lambda *_: FORCED_FORMS[form])
    inner_calls = []
    inner_call = grouped_attention._inner_call
    monkeypatch.setattr(grouped_attention, "_inner_call", lambda *a: inner_calls.append(1) or inner_call(*a))
    model = checkpointed(as_the_release_runs(copy.deepcopy(setup["model"]).to(dtype)), how)
    arguments = in_dtype(setup["arguments"], dtype)
    (batch,) = prefix_sharing.packed_batches(model, arguments)
    assert_layout_form(batch, form)
    trainer = setup["trainer"]
    reference, (plain_logps, plain_entropies) = gradients(trainer, model, arguments, "plain")
    ours, (logps, entropies) = gradients(trainer, model, arguments, "hook")
    shared = trl_seams.packed_path_reason() is None
    mode = "train" if trainer.model.training else "eval"
    assert trainer._metrics[mode][prefix_sharing.METRIC][-1] == float(shared)
    # packed: the grouped attention once per layer and call in the forward, once again in the recomputation
    calls_per_forward = len(batch.layout.calls) * model.config.text_config.num_hidden_layers
    assert len(inner_calls) == 2 * calls_per_forward * shared, (len(inner_calls), calls_per_forward)
    mask = completion_mask(arguments)
    errors = (max_error(logps, plain_logps, mask), max_error(entropies, plain_entropies, mask))
    worst = worst_relative_error(reference, ours)
    print(f"{how} {dtype} {form}: logps {errors[0]:.2e} entropies {errors[1]:.2e} gradients {worst:.2e}")
    assert max(errors) <= TOLERANCE[dtype][0] and worst <= TOLERANCE[dtype][1]
    assert model.config.text_config._attn_implementation == "sdpa", "the text model's own attention restored"


def train_two_steps(folder, dataset, out, trainer_cls=PAPOGTrainer, **overrides):
    """Two SGD steps (one generation round seen twice, reference KL on) of a float64 tiny model (``FAMILIES``) with
    a LoRA adapter, its ``PAPOGConfig`` TRL's defaults but for the CPU (``gradient_checkpointing`` as TRL sets
    it)."""
    model, processor = load_vlm(str(folder))
    torch.manual_seed(0)
    model = get_peft_model(model.to(torch.float64), lora_config(unit_params()))
    args = PAPOGConfig(
        output_dir=str(out), use_cpu=True, bf16=False, report_to="none", save_strategy="no", prefix_sharing=True,
        num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=2,
        num_iterations=2, beta=0.01, max_steps=2, logging_steps=1, optim="sgd", learning_rate=0.05,
        max_completion_length=8, generation_kwargs={"suppress_tokens": vision_special_token_ids(processor)},
        **overrides,
    )  # fmt: skip
    assert args.gradient_checkpointing, "TRL's default"
    trainer = trainer_cls(model=model, processing_class=processor, reward_funcs=[accuracy_reward, format_reward],
                          args=args, train_dataset=dataset)  # fmt: skip
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    built_plan = trainer.forward_plan
    trainer.train()
    assert trainer.model.is_activation_checkpointing, "Trainer.train turned checkpointing on"
    after = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer, built_plan, start, after


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}], ids=["trl_default", "reentrant"])
def test_trls_default_checkpointing_trains_with_sharing_as_the_plain_forward(setup, shapes_dataset, tmp_path,
                                                                            caplog, kwargs):  # fmt: skip
    overrides = {} if kwargs is None else {"gradient_checkpointing_kwargs": kwargs}
    with caplog.at_level(logging.INFO, logger="papo_nb.papo.forward_plan"):
        shared, built_plan, start, after = train_two_steps(
            setup["folder"], shapes_dataset, tmp_path / "s", **overrides
        )
    _, _, _, expected = train_two_steps(
        setup["folder"], shapes_dataset, tmp_path / "p", PlainForwardWholeGroups, **overrides
    )
    moved = max((after[n] - start[n]).abs().max().item() for n in start)
    diff = max((after[n] - expected[n]).abs().max().item() for n in start)
    plan = shared.forward_plan
    print(f"{kwargs}: parameters moved by up to {moved:.2e}, shared vs plain differ by {diff:.2e}; {plan.describe()}")
    assert moved > 1e3 * PARAMETER_BOUND and diff <= PARAMETER_BOUND
    shared_flags = [h[prefix_sharing.METRIC] for h in shared.state.log_history if prefix_sharing.METRIC in h]
    release_reason = trl_seams.packed_path_reason()
    if release_reason is None:  # every supported form: the packed forward ran in every call, under checkpointing
        assert plan.log_prob_forward == "packed per prompt group" and shared_flags and set(shared_flags) == {1.0}
        assert "gradient checkpointing on: each checkpointed layer recomputed inside the grouped layout" in (
            plan.log_prob_reason
        )
        assert built_plan.log_prob_reason.endswith("gradient checkpointing off"), "built before train()"
        assert "PAPO-G forward plan at train() start" in caplog.text
    else:  # a form prefix sharing does not reproduce: TRL's own forward ran, and the plan says so and why
        assert plan.log_prob_forward == "plain per completion" and plan.log_prob_reason == release_reason
        assert set(shared_flags) <= {0.0}


@pytest.mark.model
def test_a_checkpointing_the_layout_cannot_follow_runs_the_plain_forward_and_says_why(setup, caplog):
    from torch.distributed._composable import checkpoint

    model = as_the_release_runs(copy.deepcopy(setup["model"]))
    checkpoint(model.model.language_model.layers[0])  # recomputes through forward hooks, outside the layout
    trainer, arguments = setup["trainer"], setup["arguments"]
    sharing = trainer.prefix_sharing
    reason = sharing.reason_now(model)  # on TRL 1.14+ the release's reason comes first
    assert reason == (trl_seams.packed_path_reason() or grouped_attention.checkpointing_reason(model))
    assert "'model.language_model.layers.0' is checkpointed by torch.distributed._composable.checkpoint" in (
        grouped_attention.checkpointing_reason(model)
    )
    plan = forward_plan(trainer.args, trainer.masked_branch, sharing, model)
    assert plan.log_prob_forward == "plain per completion" and plan.log_prob_reason == reason
    with caplog.at_level(logging.WARNING, logger="papo_nb.prefix_sharing.sharing"):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, **arguments)
    assert (False, reason) in sharing.logged  # one warning per reason (the release's: logged at construction)
    assert trl_seams.packed_path_reason() or f"plain forward per completion, because {reason}" in caplog.text
    mode = "train" if trainer.model.training else "eval"
    assert trainer._metrics[mode][prefix_sharing.METRIC][-1] == 0.0
    mask = completion_mask(arguments)
    (logps * mask).sum().backward()  # no GroupedLayout ever reaches SDPA
    assert all(p.grad is not None for p in model.model.language_model.layers[0].parameters())
    unchecked = as_the_release_runs(copy.deepcopy(setup["model"]))
    assert sharing.reason_now(unchecked) == trl_seams.packed_path_reason()
    assert grouped_attention.checkpointing_reason(unchecked) is None


@pytest.mark.model
@pytest.mark.slow
def test_a_run_whose_checkpointing_the_layout_cannot_follow_trains_plain_and_its_plan_says_why(
    setup, shapes_dataset, tmp_path
):
    from torch.distributed._composable import checkpoint

    model, processor = load_vlm(str(setup["folder"]))
    checkpoint(model.model.language_model.layers[1])
    trainer = tiny_trainer(model, processor, shapes_dataset, tmp_path, num_generations=4, max_steps=1,
                           prefix_sharing=True)  # fmt: skip
    reason = trl_seams.packed_path_reason() or "is checkpointed by torch.distributed._composable.checkpoint"
    assert trainer.forward_plan.log_prob_forward == "plain per completion" and reason in (
        trainer.forward_plan.log_prob_reason
    )
    trainer.train()
    assert trainer.forward_plan.log_prob_forward == "plain per completion" and reason in (
        trainer.forward_plan.log_prob_reason
    )
    shared_flags = [h[prefix_sharing.METRIC] for h in trainer.state.log_history if prefix_sharing.METRIC in h]
    assert shared_flags == [0.0]
