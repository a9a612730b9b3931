"""The batch's path from ``PAPOGTrainer._compute_loss`` into the terms (issue 42, item 6): which of the adapter's
modules one real loss call enters, in which order, and how often it comes back to one it has left.

Counted with ``sys.setprofile`` over one ``_compute_loss`` call on the tiny Qwen2-VL: every Python function call
whose code belongs to a module of the adapter (``papo_nb.papo`` or the ``papo_nb.prefix_sharing`` it builds on) is an
event; consecutive events in one module are one *stay*; a stay
in a module already left before is a *return*. TRL's and torch's frames in between are not counted (the parent's
loss calls the adapter's log-prob hook back: that return is the hook, and it is counted)."""

from __future__ import annotations

import sys

import pytest
import torch
from peft import get_peft_model
from tiny_trainers import tiny_trainer, unit_params

from papo_nb.testbed.models import load_vlm
from papo_nb.workbook.rollouts import rollout_batch
from papo_nb.workbook.training.builder import lora_config

pytestmark = pytest.mark.model  # builds and runs the tiny VLM

G = 4
PACKAGES = ("papo_nb.papo.", "papo_nb.prefix_sharing.")


def adapter_calls(call) -> list[tuple[str, str]]:
    """``(module, function)`` of every Python call into a module of ``PACKAGES`` while ``call()`` runs, in order."""
    calls: list[tuple[str, str]] = []

    def profile(frame, event, _arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith(PACKAGES):
            calls.append((module.removeprefix("papo_nb.").removeprefix("papo."), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return calls


def module_stays(calls: list[tuple[str, str]]) -> list[str]:
    """One entry per stay: consecutive calls in one module."""
    return [module for i, (module, _) in enumerate(calls) if i == 0 or calls[i - 1][0] != module]


def path_summary(stays: list[str]) -> dict:
    """Stays, distinct modules and returns (stays in a module entered before) of a path."""
    return {"stays": len(stays), "modules": len(set(stays)), "returns": len(stays) - len(set(stays))}


def loss_call(tiny_vlm_path, shapes_dataset, folder, **overrides) -> list[tuple[str, str]]:
    """The adapter's calls during one ``_compute_loss`` of a real one-prompt round (G completions) on the tiny
    Qwen2-VL with a fresh LoRA adapter."""
    model, processor = load_vlm(str(tiny_vlm_path))
    torch.manual_seed(0)
    model = get_peft_model(model, lora_config(unit_params()))
    # the plain forward's path, as pinned below (prefix sharing, on by default, adds its own modules to every call)
    settings = dict(num_generations=G, per_device_train_batch_size=G, report_to="none", perception_loss_weight=0.02,
                    prefix_sharing=False)  # fmt: skip
    trainer = tiny_trainer(model, processor, shapes_dataset, folder, **{**settings, **overrides})
    batch = rollout_batch(trainer, shapes_dataset, n_prompts=1, seed=0)
    return adapter_calls(lambda: trainer._compute_loss(trainer.model, batch))


# The path as measured after issue 42's item 6 (before it: 51 stays, 12 modules, 39 returns with the masked branch
# in the loss call; 20, 6, 14 with the rollout's; 33, 11, 22 before the masking found the batch's layout and prompt
# groups once and handed them to the prefill). A change that lengthens it fails here; one that shortens it lowers
# the pin. What returns now: the orchestrators (papo_trainer, mask_state: it draws through masking, then paints),
# the masked branch around the prefill, the prefill around its shared helpers, and the terms around their metrics.
# Prefix sharing's own package added two round trips, one stay each way: the patch map reads where each sample's
# images are from ``prefix_sharing.image_rows`` (once: ``sample_structure``), and the trainer's log-prob hook passes
# through ``PrefixSharingMixin`` (23, 11, 12 and 9, 6, 3 before, with both inside ``papo_nb.papo``).
PINNED_PATHS = {
    "update": {"stays": 27, "modules": 13, "returns": 14},
    "rollout": {"stays": 11, "modules": 7, "returns": 4},
}


@pytest.mark.parametrize("timing", ["update", "rollout"])
def test_a_loss_call_computes_gamma_once_and_its_path_does_not_grow(tiny_vlm_path, shapes_dataset, tmp_path, timing):
    calls = loss_call(tiny_vlm_path, shapes_dataset, tmp_path / timing, masked_branch=timing)
    stays = module_stays(calls)
    summary = path_summary(stays)
    print(f"\nmasked_branch={timing!r}: {summary}: {' -> '.join(stays)}")
    assert calls.count(("schedule", "gamma_at")) == 1, "gamma_t (and from it the discount and eta) once per call"
    assert [module for module, _ in calls[:2]] == ["papo_trainer", "papo_trainer"]
    assert summary == PINNED_PATHS[timing], stays


def test_the_path_count_sees_a_return():
    """The counter itself: a module left and entered again is one return."""
    calls = [("a", "f"), ("a", "g"), ("b", "h"), ("a", "f"), ("c", "k")]
    assert module_stays(calls) == ["a", "b", "a", "c"]
    assert path_summary(module_stays(calls)) == {"stays": 4, "modules": 3, "returns": 1}
