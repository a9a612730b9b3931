"""Held-out accuracy with original and with masked images: the gap is how much the policy uses the image."""

from __future__ import annotations

from papo_nb.testbed.generation import generate_answers
from papo_nb.testbed.raw_masks import mask_images
from papo_nb.testbed.rewards import accuracy_reward
from papo_nb.workbook.evaluation.eval_review import log_heldout_completions
from papo_nb.workbook.recipe.reward import math_accuracy_reward


def evaluate_image_reliance(
    model, processor, dataset, *, mask_ratio: float = 0.6, seed: int = 0, max_new_tokens: int = 16,
    completions: str | None = "heldout",
) -> dict:  # fmt: skip
    """Greedy accuracy on original images, on images masked the official way (14x14 squares), and the gap, over all
    items and, for a dataset split by vision dependency (a ``vision_dependent`` column, the testbed's task), per split
    (``<key>/vision`` and ``<key>/text``, with ``items/<split>``).

    Shapes rows (one ``image``) are graded by the shapes reward; official-schema rows (``images`` lists, from
    ``recipe_data``) by the official boxed-answer grader. ``completions``: the name its completions table is logged
    under (None: not logged, as for a baseline scored before the run's own table)."""
    official = "images" in dataset.column_names
    grade = math_accuracy_reward if official else accuracy_reward
    was_training = model.training
    model.eval()
    try:
        prompts, answers = list(dataset["prompt"]), list(dataset["answer"])
        originals = [list(images) for images in dataset["images"]] if official else list(dataset["image"])
        masked = mask_images(originals, mask_ratio, seed)
        if completions is not None:
            log_heldout_completions(model, processor, completions, prompts, originals, answers, grade=grade,
                                    max_new_tokens=max_new_tokens, mask_ratio=mask_ratio, seed=seed)  # fmt: skip
        rewards = {}
        for name, images in (("original", originals), ("masked", masked)):
            completions = generate_answers(model, processor, prompts, images, max_new_tokens=max_new_tokens)
            rewards[name] = grade(completions, answers)
    finally:
        model.train(was_training)
    splits = {"": range(len(answers))}
    if "vision_dependent" in dataset.column_names:
        vision = list(dataset["vision_dependent"])
        splits["/vision"] = [i for i, v in enumerate(vision) if v]
        splits["/text"] = [i for i, v in enumerate(vision) if not v]
    result: dict[str, float] = {}
    for suffix, keep in splits.items():
        if not keep:
            continue
        original = sum(rewards["original"][i] for i in keep) / len(keep)
        masked_accuracy = sum(rewards["masked"][i] for i in keep) / len(keep)
        result[f"accuracy_original{suffix}"] = original
        result[f"accuracy_masked{suffix}"] = masked_accuracy
        result[f"image_reliance_gap{suffix}"] = original - masked_accuracy
        result[f"items{suffix}"] = len(keep)
    result["mask_ratio"] = mask_ratio
    return result


def policy_before_training(params):
    """(model, processor, held-out eval dataset) of the policy a run starts from: the base model, with
    ``init_adapter`` loaded where set (phase 2; a fresh LoRA adapter starts equal to the base), so the run's held-out
    accuracy has its baseline on the same items."""
    from papo_nb.workbook.training.builder import load_datasets, load_policy
    from papo_nb.workbook.training.checkpoints import load_trainable_adapter

    model, processor = load_policy(params)
    if params.init_adapter:
        model, _ = load_trainable_adapter(model, params.init_adapter)
    return model, processor, load_datasets(params)[1]
