"""The model card names the base model and the data: TRL names a base model only when it is a hub id, so a run from a
local folder (``tiny:<family>``, ``testbed:<name>``, one's own checkpoint) got "fine-tuned version of [None]".

``ModelCardCallback`` rewrites TRL's card (``README.md`` in the output folder, written before each checkpoint) as it
is saved: the base model as the run's ``model_name_or_path`` says it (and the folder it resolved to), the dataset
and the reward functions. A hub-id base model keeps TRL's link. It runs before the review callback copies the card
into the checkpoint's MLflow model.
"""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

UNNAMED_BASE = "[None](https://huggingface.co/None)"  # what TRL's template writes for base_model None
UNNAMED_PIPELINE = 'model="None"'


def card_description(params, resolved: str) -> tuple[str, str]:
    """(base model, training data) as the card says them."""
    base = f"`{params.model_name_or_path}`"
    if resolved and resolved != params.model_name_or_path:
        base += f" (the local folder `{resolved}`)"
    split = f", split `{params.train_split}`" if params.train_split else ""
    return base, f"`{params.dataset}`{split}"


def name_base_model(card: Path, params, resolved: str, rewards: list[str], run_folder: str) -> bool:
    """Rewrite ``card`` where TRL left the base model unnamed; returns whether it changed."""
    text = card.read_text()
    if UNNAMED_BASE not in text:
        return False
    base, data = card_description(params, resolved)
    trained = f"{base}, trained on {data} with the reward {', '.join(rewards)}"
    text = text.replace(UNNAMED_BASE, trained).replace(UNNAMED_PIPELINE, f'model="{run_folder}"')
    card.write_text(text)
    return True


class ModelCardCallback(TrainerCallback):
    """After each save (rank 0): the card in the output folder names the base model, the data and the rewards."""

    def __init__(self, params, resolved_model: str, rewards: list[str]):
        self.params, self.resolved, self.rewards = params, resolved_model, rewards

    def on_save(self, args, state, control, **kwargs):
        card = Path(args.output_dir) / "README.md"
        if state.is_world_process_zero and card.is_file():
            name_base_model(card, self.params, self.resolved, self.rewards, args.output_dir)
