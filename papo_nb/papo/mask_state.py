"""The trainer's masking state, one object: the generator, the per-round mask cache, the model's patch size, and the
generator's save and load with the Trainer's RNG states.

The masks themselves are the other modules': layouts and patch maps ``layouts.py``, the draw of ``round(ratio * n)``
units and its pixels ``masking.py``, a prompt's identity ``prompt_identity.py``. This object only decides which mask
a sample gets: drawn once per prompt per generation round and reused by every rollout of that prompt
(``mask_sharing="prompt"``), or a fresh draw per sample (``"completion"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..prefix_sharing import prompt_identity
from . import layouts, masking
from .perception_metrics import ROLLOUT_ROW_KEY

MASK_CACHE_LIMIT = 4096  # prompt masks remembered within one generation round (bounds memory outside train())


def generation_round(step: int, steps_per_generation: int, num_iterations: int) -> int:
    """Which generation round the trainer's ``_step``-th loss call belongs to: TRL 1.9.1 generates a new round
    when ``_step % (steps_per_generation * num_iterations) == 0`` (``_prepare_inputs``, pinned by the contract's
    ``ROUND_LENGTH``), so masks are shared within one such run of loss calls."""
    return step // (steps_per_generation * num_iterations)


@dataclass(frozen=True)
class MaskedImages:
    """A batch's masked images and what the masked forward reads of them without finding it again."""

    pixel_values: torch.Tensor
    # Rows that are one prompt with one mask, so one masked image (in order of first appearance): a prompt's rows
    # with masks shared per prompt, every row alone with a draw per completion.
    groups: list[list[int]]
    sample_rows: list[tuple[int, int]]  # each row's range of pixel_values


class MaskState:
    """Masks for one trainer process. ``model`` and ``processing_class`` are read when a mask is built (the
    vision patch size, the processor's normalisation), ``args`` is the trainer's ``PAPOGConfig``."""

    def __init__(self, args, model, processing_class):
        self.args = args
        self.model = model
        self.processing_class = processing_class
        self.generator = torch.Generator().manual_seed(args.mask_seed + args.process_index)
        self.cache: dict[str, torch.Tensor] = {}
        self.cache_round: int | None = None
        # by a completion's row in this rank's latest generation batch (ROLLOUT_ROW_KEY): the mask it trained with
        self.rollout_masks: dict[int, torch.Tensor] = {}

    def restart(self, seed: int | None = None) -> None:
        """Forget the round's masks; with ``seed``, also reseed the generator (benchmarks and tests replay masks)."""
        if seed is not None:
            self.generator.manual_seed(seed)
        self.cache, self.cache_round = {}, None

    def patch_size(self) -> int:
        """The model's own vision patch size: the vision config's, cross-checked with the image processor's."""
        image_processor = self.processing_class.image_processor
        vision = getattr(getattr(self.model, "config", None), "vision_config", None)
        sizes = {
            name: value
            for name, value in (
                ("vision_config.patch_size", getattr(vision, "patch_size", None)),
                ("image_processor.patch_size", getattr(image_processor, "patch_size", None)),
                ("image_processor.encoder_patch_size", getattr(image_processor, "encoder_patch_size", None)),
            )
            if isinstance(value, int)
        }
        if not sizes or len(set(sizes.values())) > 1:
            raise ValueError(f"cannot tell the model's vision patch size for masking: found {sizes or 'none'}")
        return next(iter(sizes.values()))

    def patch_map(self, inputs: dict[str, Any]) -> layouts.PatchMap:
        """The real patches of this batch's pixel_values, in whichever layout it has (``layouts``)."""
        image_processor = self.processing_class.image_processor
        merge = getattr(image_processor, "merge_size", 2) if self.args.mask_type == "merge_unit" else 1
        return layouts.patch_map(
            inputs,
            patch_size=self.patch_size(),
            image_mean=image_processor.image_mean,
            image_std=image_processor.image_std,
            merge_size=merge,
        )

    def excluded_entries(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """The batch entry (``masking.EXCLUDED_UNITS_KEY``) of the units each example's ``mask_excluded_column``
        excludes from masking, one row per example padded with -1 (TRL shuffles and splits it with the batch);
        nothing without the option. Refuses a missing column, a non-list value, or a non-int or negative index."""
        column = self.args.mask_excluded_column
        if column is None:
            return {}
        rows = []
        for i, example in enumerate(examples):
            value = example.get(column)
            if not isinstance(value, (list, tuple)) or not all(isinstance(u, int) and u >= 0 for u in value):
                raise ValueError(
                    f"mask_excluded_column={column!r}: example {i} holds {value!r}; allowed: a list of unit indices "
                    f">= 0 (the dataset's column {column!r}, present in every example)"
                )
            rows.append(list(value))
        width = max(map(len, rows), default=0)
        return {
            masking.EXCLUDED_UNITS_KEY: torch.tensor([r + [-1] * (width - len(r)) for r in rows]).reshape(-1, width)
        }

    def _excluded(self, inputs: dict[str, Any], patches: layouts.PatchMap, sample: int) -> torch.Tensor | None:
        table = inputs.get(masking.EXCLUDED_UNITS_KEY)
        if table is None:
            if self.args.mask_excluded_column is not None:
                raise ValueError(
                    f"mask_excluded_column={self.args.mask_excluded_column!r} but the batch has no excluded units "
                    f"({masking.EXCLUDED_UNITS_KEY}); allowed: batches built by PAPOGTrainer's generation"
                )
            return None
        if self.args.mask_type == "random":
            raise ValueError(
                "mask_excluded_column excludes patch units; mask_type='random' masks single values; allowed: "
                "mask_type 'auto' or 'merge_unit'"
            )
        indices = [u for u in table[sample].tolist() if u >= 0]
        return masking.excluded_units(int(patches.sample_units[sample].sum()), indices, sample=sample)

    def draw(self, patches: layouts.PatchMap, sample: int, sample_pixels: torch.Tensor, excluded=None) -> torch.Tensor:
        """A fresh mask for one sample: a bool per patch unit (never one of ``excluded``), or (``random``) a coin
        per pixel value."""
        if self.args.mask_type == "random":
            return torch.rand(sample_pixels.shape, generator=self.generator) < self.args.mask_ratio
        return masking.select_units(patches.sample_units[sample], self.args.mask_ratio, self.generator, excluded)

    def sample_masks(
        self, inputs: dict[str, Any], patches: layouts.PatchMap, round_: int | None, keys: list[str] | None
    ) -> list:
        """One mask per sample. With the samples' prompt ``keys`` (``mask_sharing='prompt'``): drawn once per prompt
        per generation round ``round_`` (None: no round, nothing kept) and reused by every rollout of that prompt, in
        this device batch or a later one of the same round (TRL shuffles rollouts across them); without
        (``'completion'``): a fresh draw each."""
        pixel_values = inputs["pixel_values"]
        excluded = [self._excluded(inputs, patches, i) for i in range(len(patches.sample_rows))]
        if keys is None:
            rows = enumerate(patches.sample_rows)
            return [self.draw(patches, i, pixel_values[a:b], excluded[i]) for i, (a, b) in rows]
        if round_ is None or round_ != self.cache_round or len(self.cache) > MASK_CACHE_LIMIT:
            self.cache, self.cache_round = {}, round_
        for i, (start, end) in enumerate(patches.sample_rows):
            if keys[i] not in self.cache:
                self.cache[keys[i]] = self.draw(patches, i, pixel_values[start:end], excluded[i])
        return [self.cache[key] for key in keys]

    def masked_images(self, inputs: dict[str, Any], round_: int | None) -> MaskedImages:
        """``pixel_values`` with the masks of ``mask_type`` applied, filled with ``mask_fill`` (default black after
        normalisation), only on real patches (padding pixels and padded tiles stay as they are) and never on a unit
        the batch's excluded units name; a new tensor, the input is never written. The batch's patch map and prompt
        identity are found once here and handed on with the pixels (``MaskedImages``)."""
        patches = self.patch_map(inputs)
        keys, groups = None, [[i] for i in range(len(patches.sample_rows))]
        if self.args.mask_sharing == "prompt":
            keys, groups = prompt_identity.keys_and_groups(inputs, patches)
        masks = self.sample_masks(inputs, patches, round_, keys)
        for i, row in enumerate(inputs.get(ROLLOUT_ROW_KEY, torch.empty(0)).tolist()):
            self.rollout_masks[row] = masks[i].cpu()  # for a reviewer: the exact mask this completion trained with
        apply = masking.apply_values if self.args.mask_type == "random" else masking.apply_units
        pixels = apply(patches, inputs["pixel_values"], torch.cat(masks), self.args.mask_fill)
        return MaskedImages(pixels, groups, patches.sample_rows)

    # ---- checkpoints: the generator is resumed with the RNG states the Trainer saves ----
    def rng_file(self, folder: str) -> str:
        return os.path.join(folder, f"papo_mask_rng_{self.args.process_index}.pth")

    def save(self, folder: str) -> None:
        torch.save(self.generator.get_state(), self.rng_file(folder))

    def load(self, folder: str | None) -> None:
        """Resume the generator from ``folder`` where it holds one; the round's masks are dropped (TRL regenerates
        rollouts after a resume)."""
        if folder is not None and os.path.isfile(self.rng_file(folder)):
            self.generator.set_state(torch.load(self.rng_file(folder), weights_only=True))
            self.restart()
