"""What the whole-group shuffle of prefix sharing changes, per loss type: each group's expected share of TRL 1.9.1's
per-token loss weights on a toy round, under TRL's row shuffle and under the whole-group shuffle.

The weights are TRL's own: ``GRPOTrainer._compute_loss`` runs on each micro-batch of a shuffled, split round with
the log-probs (and entropies) as leaf tensors, advantages 1 and old log-probs equal to the new ones, so that each
token's gradient is its weight in the optimizer step. The round: G 4, 4 groups, 2 micro-batches per optimizer step
(``steps_per_generation`` = gradient accumulation = 2), one group with long completions. Loss types whose weights
do not depend on the split have the same shares to float rounding under both shuffles; ``bnpo`` (a micro-batch
token count), ``top_entropy_quantile`` (a micro-batch quantile) and TRL's entropy bonus (a micro-batch mean) move.
"""

import collections

import pytest
import torch
from tiny_trainers import tiny_trainer
from trl import GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.testbed.models import load_vlm

GROUP = 4
LENGTHS = [[12, 11, 12, 10], [3, 2, 4, 3], [2, 3, 3, 2], [4, 3, 2, 3]]  # group 0: the long completions
DRAWS = 100
# loss type, TRL attributes set for it, which weights are measured ("logps": the policy term, "entropies": the bonus)
CASES = {
    "grpo": ({}, "logps"),
    "bnpo": ({}, "logps"),
    "dr_grpo": ({}, "logps"),
    "dapo": ({}, "logps"),
    "luspo": ({"importance_sampling_level": "sequence"}, "logps"),
    "cispo": ({}, "logps"),
    "sapo": ({}, "logps"),
    "grpo+top_entropy_quantile": ({"top_entropy_quantile": 0.5}, "logps"),
    "grpo+entropy_bonus": ({"_entropy_bonus_enabled": True, "entropy_coef": 1.0}, "entropies"),
}
SPLIT_FREE = ("grpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")


def toy_round():
    rows = GROUP * len(LENGTHS)
    width = max(map(max, LENGTHS))
    lengths = torch.tensor([length for group in LENGTHS for length in group])
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    completion_ids = torch.zeros((rows, width), dtype=torch.long)
    completion_ids[:, 0] = torch.arange(rows)  # the row's identity, for the leaf log-probs below
    return {
        "prompt_ids": torch.ones((rows, 2), dtype=torch.long),
        "prompt_mask": torch.ones((rows, 2), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.ones(rows),
        "num_items_in_batch": completion_mask.sum(),
        prefix_sharing.BLOCK_KEY: torch.arange(rows) // GROUP,
    }


def group_shares(trainer, loss_type: str, shuffle) -> list[float]:
    """Each group's mean share of the optimizer step's summed token weights over ``DRAWS`` shuffles."""
    attributes, measured = CASES[loss_type]
    trainer.loss_type = loss_type.split("+")[0]
    for name, value in attributes.items():
        setattr(trainer, name, value)
    round_inputs = toy_round()
    mask = round_inputs["completion_mask"].bool()
    generator = torch.Generator().manual_seed(3)
    entropies_all = torch.rand(mask.shape, generator=generator, dtype=torch.float64)
    entropies_all[:GROUP] += 0.5  # the long group's tokens more uncertain: where a micro-batch quantile bites
    totals = torch.zeros(len(LENGTHS), dtype=torch.float64)
    torch.manual_seed(0)
    for _ in range(DRAWS):
        logps = torch.full(mask.shape, -1.0, dtype=torch.float64, requires_grad=True)
        entropies = entropies_all.clone().requires_grad_(True)

        def leaf_forward(model, input_ids, *args, logps=logps, entropies=entropies, **kwargs):
            rows = input_ids[:, -mask.shape[1]]  # completion_ids[:, 0]: the row's identity
            return logps[rows], entropies[rows], None

        trainer._get_per_token_logps_and_entropies = leaf_forward
        for micro_batch in split_tensor_dict(shuffle(round_inputs), 2):
            GRPOTrainer._compute_loss(trainer, trainer.model, micro_batch).backward()
        weights = (-(logps.grad) if measured == "logps" else -(entropies.grad)) * mask
        per_group = weights.sum(1).view(len(LENGTHS), GROUP).sum(1)
        totals += per_group / per_group.sum()
    return (totals / DRAWS).tolist()


@pytest.fixture(scope="module")
def trainer(tiny_vlm_path, shapes_dataset, tmp_path_factory):
    model, processor = load_vlm(str(tiny_vlm_path))
    trainer = tiny_trainer(
        model, processor, shapes_dataset, tmp_path_factory.mktemp("weights") / "t", trainer_cls=GRPOTrainer,
        num_generations=GROUP, per_device_train_batch_size=8, steps_per_generation=2, gradient_accumulation_steps=2,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


@pytest.mark.model
def test_each_loss_types_group_weights_under_both_shuffles(trainer):
    defaults = {name: getattr(trainer, name) for name in ("top_entropy_quantile", "_entropy_bonus_enabled")}
    measured = collections.OrderedDict()
    for loss_type in CASES:
        try:
            rows = group_shares(trainer, loss_type, shuffle_sequence_dict)
            blocks = group_shares(trainer, loss_type, prefix_sharing.shuffle_whole_blocks)
        finally:
            for name, value in defaults.items():
                setattr(trainer, name, value)
            trainer.importance_sampling_level = "token"
        measured[loss_type] = (rows[0], blocks[0])
        print(f"{loss_type}: long group's expected weight share {rows[0]:.3f} (row shuffle), {blocks[0]:.3f} (groups)")
        assert sum(rows) == pytest.approx(1.0) and sum(blocks) == pytest.approx(1.0)
    for loss_type in SPLIT_FREE:
        rows, blocks = measured[loss_type]
        assert abs(rows - blocks) < 1e-9, (loss_type, rows, blocks)
    for loss_type in ("bnpo", "grpo+top_entropy_quantile", "grpo+entropy_bonus"):
        rows, blocks = measured[loss_type]
        assert abs(rows - blocks) > 0.02, (loss_type, rows, blocks)
    assert measured["grpo"][0] == pytest.approx(0.25)  # per sequence: every row the same weight
