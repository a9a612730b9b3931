"""The PAPO-G adapter alone: config, trainer, masking, TRL contract rules and the gamma-zero probe.

Imports torch, transformers, trl and peft only (a test enforces it), so it can be lifted into any TRL project.
"""

from .papo_config import PAPOGConfig
from .papo_trainer import PAPOGTrainer

__all__ = ["PAPOGConfig", "PAPOGTrainer"]
