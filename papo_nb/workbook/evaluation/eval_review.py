"""What a reviewer finds in MLflow of a held-out evaluation (notebook 03's last cells, notebook 05): the evaluated
policy as a LoggedModel that the evaluation's metrics attach to, the benchmarks as dataset inputs, and a table of
completions on original and masked images. Every function does nothing without an active MLflow run."""

from __future__ import annotations

import time
from pathlib import Path

import mlflow
import pandas as pd
import torch
from mlflow import MlflowClient

from papo_nb.testbed.generation import generate_answers
from papo_nb.testbed.raw_masks import image_mask_seed, mask_images, square_mask
from papo_nb.workbook.training import review
from papo_nb.workbook.training.completions import MASK_VIEW_COLUMNS, mask_rendering, thumbnail

REVIEW_ROWS = 4  # held-out items per completions table, each greedy on its original and its masked image(s)


_BENCHMARK_NAMES: dict[str, str] = {}  # a benchmark's rows (their fingerprint) -> its name, from log_benchmark_inputs


def benchmark_name(rows) -> str:
    """The name ``log_benchmark_inputs`` saw for these rows, else their fingerprint."""
    fingerprint = getattr(rows, "_fingerprint", "") or "rows"
    return _BENCHMARK_NAMES.get(fingerprint, fingerprint[:12])


def prompt_text(prompt) -> str:
    """The text of a chat prompt (its turns' text parts), or the prompt itself."""
    if not isinstance(prompt, list):
        return str(prompt)
    parts = []
    for turn in prompt:
        content = turn.get("content", "") if isinstance(turn, dict) else turn
        if isinstance(content, list):
            parts += [str(item.get("text", "")) for item in content if isinstance(item, dict) and item.get("text")]
        else:
            parts.append(str(content))
    return "\n".join(parts)


def _first_image(images):
    return (images[0] if images else None) if isinstance(images, list) else images


RAW_MASK_SQUARE = 14  # the official raw-image mask's square (``raw_masks.square_mask``): the overlay's patch


def heldout_mask_views(image, mask_ratio: float, seed: int, row: int, listed: bool) -> dict:
    """Row ``row``'s (first) image as the masked condition showed it, with the training table's rendering
    (``completions.mask_rendering``): the pixels the model received, the legend-coloured overlay, the share of the
    image's content the mask covered and whether it missed all of it. Its mask is the scored one (same seed)."""
    seed = image_mask_seed(seed, row, 0 if listed else None)
    per_pixel = square_mask(image.height, image.width, mask_ratio, square=RAW_MASK_SQUARE, seed=seed)
    return mask_rendering(image, per_pixel, RAW_MASK_SQUARE)


@torch.no_grad()
def log_heldout_completions(
    model, processor, name: str, prompts: list, originals: list, answers: list[str], *, grade, max_new_tokens: int,
    mask_ratio: float, seed: int,
) -> dict | None:  # fmt: skip
    """``completions/heldout_<name>.json``: the first ``REVIEW_ROWS`` items, each with its (first) original image,
    its masked image drawn as the training table draws it (``MASK_VIEW_COLUMNS``), the greedy completion on the
    original and on the masked images (``raw_masks.mask_images`` with ``mask_ratio`` and ``seed``, the masks the
    scores used) and its grade. The completions are generated again for these rows (same greedy decoding, smaller
    batch). Returns the cost (rows, images, pixels, seconds) or None without a run."""
    run = mlflow.active_run()
    if run is None:
        return None
    start = time.perf_counter()
    n = min(REVIEW_ROWS, len(prompts))
    originals = list(originals[:n])
    table = {"benchmark": [name] * n, "prompt": [prompt_text(prompt)[:2000] for prompt in prompts[:n]]}
    table["image"] = [thumbnail(_first_image(images)) for images in originals]
    views = [
        heldout_mask_views(_first_image(images), mask_ratio, seed, i, isinstance(images, list))
        for i, images in enumerate(originals)
    ]
    table.update({column: [view[column] for view in views] for column in MASK_VIEW_COLUMNS})
    table["answer"] = list(answers[:n])
    for condition, shown in (("original", originals), ("masked", mask_images(originals, mask_ratio, seed))):
        completions = generate_answers(model, processor, prompts[:n], shown, max_new_tokens=max_new_tokens)
        table[f"completion_{condition}"] = completions
        table[f"correct_{condition}"] = [float(g) for g in grade(completions, list(answers[:n]))]
    pictures = table["image"] + table["model_input"] + table["masked_image"]
    MlflowClient(mlflow.get_tracking_uri()).log_table(
        run.info.run_id, data=pd.DataFrame(table), artifact_file=f"completions/heldout_{name}.json"
    )
    pixels = sum(p.width * p.height for p in pictures)
    return {"rows": n, "images": len(pictures), "pixels": pixels, "seconds": time.perf_counter() - start}


def use_evaluated_model(params, checkpoint: Path | None, described: str) -> str | None:
    """Make the evaluated policy the active MLflow model, so the evaluation's metrics attach to it: the LoggedModel
    notebook 03 logged for ``checkpoint``, else a new external one (the base model, or a checkpoint from elsewhere)
    recording where its weights are. Returns its id, None without a run."""
    run = mlflow.active_run()
    if run is None:
        return None
    model_id = review.find_checkpoint_model(run.info.experiment_id, checkpoint) if checkpoint else None
    if model_id is None:
        path = checkpoint.resolve() if checkpoint else params.model_name_or_path
        model = mlflow.create_external_model(
            name=f"{run.info.run_name}-{checkpoint.name if checkpoint else 'base'}",
            source_run_id=run.info.run_id,
            experiment_id=run.info.experiment_id,
            model_type="papo-g checkpoint" if checkpoint else "base model",
            tags={
                review.CHECKPOINT_PATH_TAG: str(path),
                "papo_nb.weights": f"on disk, not copied: {path}",
                **review.model_source_tags(run),
            },
            params={"described": described[:6000], "base_model": params.model_name_or_path},
        )
        model_id = model.model_id
    mlflow.set_active_model(model_id=model_id)
    return model_id


def heldout_input(params, eval_dataset):
    """The held-out set as the MLflow dataset the training run logged as its ``evaluation`` input (same name, source
    and digest), to pass with the held-out metrics so that the evaluated checkpoint lists them beside it."""
    source = review.dataset_source(params, params.dataset)
    return review.dataset_input(eval_dataset, f"{params.dataset}-heldout", source)


def benchmark_input(params, name: str, rows):
    """Benchmark ``name``'s rows as the MLflow dataset ``log_benchmark_inputs`` logged for them."""
    source = review.dataset_source(params, params.eval_dataset)
    return review.dataset_input(rows, f"{params.eval_dataset}-{name}", source)


def log_benchmark_inputs(params, suites: dict) -> None:
    """Each benchmark's rows as an evaluation dataset input of the active run (``suites`` from ``benchmark_rows``)."""
    run = mlflow.active_run()
    if run is None:
        return
    source = review.dataset_source(params, params.eval_dataset)
    named = {f"{params.eval_dataset}-{name}": (rows, source, "evaluation") for name, (rows, _, _) in suites.items()}
    _BENCHMARK_NAMES.update({rows._fingerprint: name for name, (rows, _, _) in suites.items()})
    review.log_dataset_inputs(MlflowClient(mlflow.get_tracking_uri()), run.info.run_id, named)
