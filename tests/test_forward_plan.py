"""Every combination of the forward fields (issue 42, item 6): ``forward.plan.forward_fields_problem`` is the one
place they are checked, and ``PAPOGConfig`` refuses each invalid combination before any model loads, with every
field the rule joins and its value. No model: configs only."""

from __future__ import annotations

import itertools
import re

import pytest

from papo_nb.papo import PAPOGConfig
from papo_nb.papo.papo_config import (
    FORWARD_FIELDS,
    MASK_SHARING,
    MASKED_BRANCH_TIMINGS,
    MASKED_FORWARDS,
    forward_fields_problem,
)

CHOICES = {
    "masked_branch": MASKED_BRANCH_TIMINGS,
    "masked_branch_grad": (False, True),
    "masked_forward": MASKED_FORWARDS,
    "prefix_sharing": ("auto", False, True),
    "mask_sharing": MASK_SHARING,
}
# Two device batches: 8 rows of whole groups of 4, and 6 rows, which split a group of 4 (generation batch 12).
BATCHES = ({"per_device_train_batch_size": 8}, {"per_device_train_batch_size": 6, "steps_per_generation": 2})


def config(tmp_path, **fields) -> PAPOGConfig:
    return PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{"num_generations": 4, **fields})


def named_fields(message: str) -> dict[str, str]:
    """``field=value`` pairs a message names before its ``allowed:`` part."""
    return dict(re.findall(r"(\w+)=('[^']*'|\w+)", message.split("allowed:")[0]))


def test_every_combination_is_built_or_refused_naming_the_fields_it_joins(tmp_path):
    outcomes = {"valid": 0, "refused": 0}
    for values, batch in itertools.product(itertools.product(*CHOICES.values()), BATCHES):
        fields = {**dict(zip(CHOICES, values)), **batch, "num_generations": 4}
        try:
            built = config(tmp_path, **fields)
        except ValueError as error:
            message = str(error)
            assert message.startswith("PAPOGConfig.") and "allowed:" in message, message
            named = named_fields(message)
            assert len(named) >= 2, message  # a combination: at least two fields, each with its value
            for name, value in named.items():
                assert value.strip("'") == str(fields[name]), (name, value, fields)
            assert set(named) & set(FORWARD_FIELDS), message
            outcomes["refused"] += 1
            continue
        assert forward_fields_problem(built) is None
        outcomes["valid"] += 1
    # 72 combinations of the five fields, under two batches. Refused per batch: rollout with grad (18), the shared
    # prefix with grad at update (6), the shared prefix with per-completion masks at rollout without grad (3): 27,
    # 45 valid; the 6-row batch also refuses the 15 of those 45 that force prefix sharing (True). "auto" is never
    # refused for the batch: it is off there (PrefixSharing says why).
    assert outcomes == {"valid": 45 + 30, "refused": 27 + 27 + 15}, outcomes


def test_the_recipes_forward_fields_pass_the_one_check(tmp_path):
    """The official timing and its recompute option, with the prefix paths on and off, are valid combinations."""
    for fields in (
        dict(masked_branch="rollout", masked_branch_grad=False, masked_forward="auto", prefix_sharing=True),
        dict(masked_branch="update", masked_branch_grad=True, masked_forward="full", prefix_sharing=False),
        dict(
            masked_branch="update", masked_branch_grad=False, masked_forward="shared_prefix", mask_sharing="completion"
        ),
    ):
        assert forward_fields_problem(config(tmp_path, per_device_train_batch_size=8, **fields)) is None
    with pytest.raises(
        ValueError, match=r"PAPOGConfig\.masked_branch='rollout' is invalid with masked_branch_grad=True"
    ):
        config(tmp_path, per_device_train_batch_size=8, masked_branch_grad=True)
