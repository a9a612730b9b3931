"""Fixed rollout batches: the exact ``_compute_loss`` inputs of one step, shared by the probe notebooks (01, 02),
the benchmarks and the tests."""

from __future__ import annotations

from typing import Any

import torch


def rollout_batch(trainer, dataset, n_prompts: int, *, start: int = 0, seed: int = 0) -> dict[str, Any]:
    """Generate and score ``num_generations`` completions for each of ``n_prompts`` prompts, as a training step
    would, and return the dict that ``_compute_loss`` receives. Global RNG state is left untouched."""
    if start + n_prompts > len(dataset):
        raise ValueError(
            f"rollout_batch needs prompts {start}..{start + n_prompts - 1} but the dataset has {len(dataset)}"
        )
    rows = [dataset[i] for i in range(start, start + n_prompts) for _ in range(trainer.num_generations)]
    trainer.model.train()
    # Trainer sets this in its training loop; a loss computed outside train() needs it too.
    if not hasattr(trainer, "current_gradient_accumulation_steps"):
        trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return trainer._generate_and_score_completions(rows)


def clone_batch(inputs: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a batch's tensors (lists and scalars are copied shallowly)."""
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else (list(v) if isinstance(v, list) else v)
        for k, v in inputs.items()
    }
