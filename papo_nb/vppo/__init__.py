"""VPPO (arXiv 2510.09285), the second masked-branch method beside PAPO-G: the same masked branch, used to filter
tokens and scale advantages.

- ``vppo_config.py``: ``VPPOConfig``, PAPOGConfig plus the token fraction and the advantage band, official defaults.
- ``vppo_trainer.py``: ``VPPOTrainer``, PAPO-G's trainer at gamma 0 whose GRPO loss reads shaped advantages.
- ``shaping.py``: the per-token maths (dependency, kept tokens, trajectory scale), free of the trainer.
"""

from .vppo_config import VPPOConfig
from .vppo_trainer import VPPOTrainer

__all__ = ["VPPOConfig", "VPPOTrainer"]
