"""The tests' one way to a trainer on the tiny model: the workbook's builder (``papo_config``, ``build_trainer``,
``lora_config``) with the settings under which the tiny model trains on the CPU in a fraction of a second a step.

Imported by test modules as ``from tiny_trainers import ...`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

from pathlib import Path

from papo_nb.papo import PAPOGTrainer
from papo_nb.workbook.config.params import WorkbookParams
from papo_nb.workbook.training.builder import build_trainer, papo_config

# No reference model (beta 0: no second forward), a learning rate at LoRA scale (1e-3 moves a fresh adapter within
# a few steps), 8 completions a step, and no gamma-zero probe inside training unless a test asks for it.
UNIT_TEST_SETTINGS = dict(
    learning_rate=1e-3, beta=0.0, per_device_train_batch_size=8, max_steps=4, require_gpu_contract_probe=False
)


def unit_params(**fields) -> WorkbookParams:
    """Workbook parameters for a unit test: the schema's defaults, ``UNIT_TEST_SETTINGS``, then ``fields``."""
    return WorkbookParams(**{**UNIT_TEST_SETTINGS, **fields})


def tiny_trainer(model, processor, dataset, output_dir: str | Path, trainer_cls=PAPOGTrainer, **config_overrides):
    """A trainer from ``unit_params()`` through the builder; ``config_overrides`` are config fields (they win).

    A plain model gets a fresh LoRA adapter, a PeftModel trains as it is. ``trainer_cls=GRPOTrainer`` is the
    parent: it reads the GRPO fields of the same config and ignores PAPO-G's, so both run the same GRPO settings.
    """
    params = unit_params()
    args = papo_config(params, output_dir, processor, save_strategy="no", **config_overrides)
    return build_trainer(params, args, model, processor, dataset, trainer_cls=trainer_cls)
