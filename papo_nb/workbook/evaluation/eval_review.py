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
from papo_nb.workbook.training import review
from papo_nb.workbook.training.completions import thumbnail

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


@torch.no_grad()
def log_heldout_completions(
    model, processor, name: str, prompts: list, originals: list, masked: list, answers: list[str], *, grade,
    max_new_tokens: int,
) -> dict | None:  # fmt: skip
    """``completions/heldout_<name>.json``: the first ``REVIEW_ROWS`` items, each with its (first) original and
    masked image, the greedy completion on each and its grade. The completions are generated again for these rows
    (same greedy decoding, smaller batch). Returns the cost (rows, images, pixels, seconds) or None without a run."""
    run = mlflow.active_run()
    if run is None:
        return None
    start = time.perf_counter()
    n = min(REVIEW_ROWS, len(prompts))
    table = {"benchmark": [name] * n, "prompt": [], "image": [], "masked_image": [], "answer": list(answers[:n])}
    table["prompt"] = [prompt_text(prompt)[:2000] for prompt in prompts[:n]]
    for condition, shown in (("original", originals[:n]), ("masked", masked[:n])):
        completions = generate_answers(model, processor, prompts[:n], shown, max_new_tokens=max_new_tokens)
        table[f"completion_{condition}"] = completions
        table[f"correct_{condition}"] = [float(g) for g in grade(completions, list(answers[:n]))]
    table["image"] = [thumbnail(_first_image(images)) for images in originals[:n]]
    table["masked_image"] = [thumbnail(_first_image(images)) for images in masked[:n]]
    pixels = sum(p.width * p.height for p in table["image"] + table["masked_image"])
    MlflowClient(mlflow.get_tracking_uri()).log_table(
        run.info.run_id, data=pd.DataFrame(table), artifact_file=f"completions/heldout_{name}.json"
    )
    return {"rows": n, "images": 2 * n, "pixels": pixels, "seconds": time.perf_counter() - start}


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
            tags={review.CHECKPOINT_PATH_TAG: str(path), "papo_nb.weights": f"on disk, not copied: {path}"},
            params={"described": described[:6000], "base_model": params.model_name_or_path},
        )
        model_id = model.model_id
    mlflow.set_active_model(model_id=model_id)
    return model_id


def log_benchmark_inputs(params, suites: dict) -> None:
    """Each benchmark's rows as an evaluation dataset input of the active run (``suites`` from ``benchmark_rows``)."""
    run = mlflow.active_run()
    if run is None:
        return
    source = review.dataset_source(params, params.eval_dataset)
    named = {f"{params.eval_dataset}-{name}": (rows, source, "evaluation") for name, (rows, _, _) in suites.items()}
    _BENCHMARK_NAMES.update({rows._fingerprint: name for name, (rows, _, _) in suites.items()})
    review.log_dataset_inputs(MlflowClient(mlflow.get_tracking_uri()), run.info.run_id, named)
