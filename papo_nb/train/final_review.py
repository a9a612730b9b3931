"""What makes a ``papo-nb train`` run reviewable like notebook 03's: after the last step, the trained policy's
held-out evaluation of ``eval_split`` (accuracy with and without the image, as 03 logs it), its training curves and
the run's results page (``results.page``, the Description MLflow opens the run on).

``--skip-eval`` leaves the evaluation out (the page is still written). Runs inside a launched job leave both to the
process that launched it (``papo-nb train`` with ``num_processes > 1``), which reads the last checkpoint.
"""

from __future__ import annotations

from papo_nb.train.run_folder import PROGRESS_PREFIX


def review_run(params, outcome, policy, *, evaluate: bool = True) -> dict | None:
    """Evaluate ``outcome``'s policy (``policy()``: model, processor, held-out dataset) on the held-out split into its
    MLflow run (unless ``evaluate`` is False), then write the run's results page. Returns the evaluation (None when
    skipped, or when the run has no MLflow run)."""
    import mlflow
    from mlflow import MlflowClient

    from papo_nb.infra import tracking
    from papo_nb.workbook.results.page import publish_notebook_page

    if not outcome.mlflow_run_id:
        return None
    _, owns = tracking.attach_run("", outcome.mlflow_run_id, run_name="", tags={})
    final, status = None, "FAILED"  # a run whose evaluation broke is not a finished run to read numbers from
    try:
        log_training_curves(outcome)
        if evaluate:
            final = heldout_evaluation(params, *policy())
            mlflow.set_tag("papo_nb.last_checkpoint", str(outcome.last_checkpoint))
        publish_notebook_page(MlflowClient(), outcome.mlflow_run_id)
        status = "FINISHED"
    finally:
        if owns:
            mlflow.end_run(status=status)
    return final


def log_training_curves(outcome) -> None:
    """Notebook 03's training-curves figure, which the results page shows."""
    import matplotlib.pyplot as plt

    from papo_nb.infra import tracking
    from papo_nb.workbook.training.figures import plot_training_curves

    if outcome.step_logs:
        figure = plot_training_curves(outcome.step_logs)
        tracking.log_figure(figure, "training_curves")
        plt.close(figure)


def heldout_evaluation(params, model, processor, eval_dataset) -> dict:
    """The trained policy on the held-out split, logged as notebook 03 logs it (``evidence/evaluation.json``,
    ``eval/*`` metrics linked to the held-out dataset); one line with the accuracies."""
    from papo_nb.infra import tracking
    from papo_nb.workbook.evaluation.eval_review import heldout_input
    from papo_nb.workbook.evaluation.heldout import evaluate_image_reliance

    final = evaluate_image_reliance(
        model, processor, eval_dataset, mask_ratio=params.mask_ratio, seed=params.seed,
        max_new_tokens=params.max_completion_length,
    )  # fmt: skip
    tracking.log_evidence("evaluation", final, prefix="eval", dataset=heldout_input(params, eval_dataset))
    print(
        f"{PROGRESS_PREFIX} held-out evaluation ({len(eval_dataset)} items of {params.dataset!r}): accuracy "
        f"{final['accuracy_original']:.3f} with the image, {final['accuracy_masked']:.3f} with it masked",
        flush=True,
    )
    return final
