"""The completions table of a PAPO-G run: one MLflow table (``completions.json``, ``log_table``) across steps, a row
per completion with a ``step`` column, so that the artifact view goes through steps and compares rows by reward or KL.

Every value of a row is that row's own, found by its position in the generation batch: TRL keeps the latest rollouts
in order (``trainer._logs``), and ``PAPOGTrainer`` keeps, for the same positions (``ROLLOUT_ROW_KEY``, carried
through TRL's shuffle), each completion's perception terms and the exact mask selection its masked branch used
(``perception_record.rollout``, ``masks.rollout_masks``). Nothing is keyed by prompt text, which two items may share.

Each row shows its mask twice, at the model's input size (``mask_views``): ``model_input``, the pixels the masked
branch received (masked patches black), and ``masked_image``, the same selection drawn grey with a magenta outline,
which shows on a black background too, with a legend drawn under it (the marking, the content covered, the
missed-content flag in red: ``with_legend``); ``mask_content_share`` is the share of the image's content pixels the
mask covered and ``mask_missed_content`` marks a row whose mask covered none of them (its perception KL is then about
0 by construction, not a dead branch). They are drawn for the Qwen-VL patch-row layout and for whole-image layouts;
other layouts log the image without them. The held-out tables draw their raw-image masks with the same
``mask_rendering``.

A VPPO run's rows also carry what VPPO did to each completion (``VPPOTrainer.rollout_review``): its mean token
dependency (the per-token KL its filter ranks by), the share of its tokens that kept their policy gradient, and the
scale its advantage was multiplied by (``advantage`` is TRL's, before the scale).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import numpy as np
import pandas as pd
import torch
from mlflow import MlflowClient
from PIL import Image, ImageDraw

from papo_nb.papo import masking
from papo_nb.prefix_sharing import image_rows
from papo_nb.vppo.vppo_trainer import REVIEW_COLUMNS as VPPO_COLUMNS

REVIEW_PROMPTS = 2  # items per step in the table (each with all its completions, at most the next bound)
REVIEW_COMPLETIONS_PER_PROMPT = 8
THUMBNAIL_PIXELS = 128  # longest side of a thumbnail; smaller images are kept as they are
MASK_GREY = (128, 128, 128)
MASK_OUTLINE = (255, 0, 255)  # magenta: visible on the testbed's and on natural images
TABLE_FILE = "completions.json"


def thumbnail(image: Image.Image) -> Image.Image:
    copy = image.convert("RGB")
    copy.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    return copy


def image_digest(image: Image.Image) -> str:
    """A short id of an item's image: equal exactly when the pixels are (what tells two items apart)."""
    pixels = np.asarray(image.convert("RGB"))
    return hashlib.blake2b(pixels.tobytes() + str(pixels.shape).encode(), digest_size=6).hexdigest()


def _grid_rows_to_pixels(chosen: torch.Tensor, grid: torch.Tensor, patch: int, merge: int) -> torch.Tensor:
    """Qwen-VL patch rows ``(t*h*w, C*T*P*P)`` of booleans back to an ``(h*P, w*P)`` image of the first frame: the
    processor orders rows (t, h/m, w/m, m, m) and a row's values (C, T, P, P)."""
    t, h, w = (int(x) for x in grid[0])
    channels = chosen.shape[1] // (patch * patch)
    blocks = chosen.reshape(t, h // merge, w // merge, merge, merge, channels, patch, patch).any(5)
    return blocks.permute(0, 1, 3, 5, 2, 4, 6).reshape(t, h * patch, w * patch)[0]


def mask_pixels(trainer, image: Image.Image, selection: torch.Tensor) -> tuple[Image.Image, np.ndarray] | None:
    """``image`` at the model's input size and a bool per pixel: what ``selection`` (the trainer's mask of this
    sample, one bool per unit, or per value for ``random``) masked. None for a layout this cannot draw."""
    processor = trainer.processing_class.image_processor
    processed = dict(processor(images=[image.convert("RGB")], return_tensors="pt"))
    inputs = {**processed, "num_images": [1], "prompt_ids": torch.zeros(1, 1, dtype=torch.long)}
    layout = image_rows.detect_layout(inputs)
    patches = trainer.masks.patch_map(inputs)
    pixel_values = inputs["pixel_values"]
    if trainer.args.mask_type == "random":
        chosen = selection.to(torch.bool) & patches.real_pixels
    else:
        chosen = masking.selected_pixels(patches, selection)
    chosen = chosen.expand_as(pixel_values).cpu()
    if layout == "grid_rows":
        patch, merge = trainer.masks.patch_size(), getattr(processor, "merge_size", 1)
        grid = inputs["image_grid_thw"]
        per_pixel = _grid_rows_to_pixels(chosen, grid, patch, merge)
    elif layout in ("images", "sized_images"):
        per_pixel = chosen[0].any(0)
    else:
        return None
    height, width = per_pixel.shape
    return image.convert("RGB").resize((width, height)), per_pixel.numpy()


def draw_mask(image: Image.Image, per_pixel: np.ndarray, patch: int) -> Image.Image:
    """Masked pixels grey, each masked patch outlined, on a copy of ``image``."""
    pixels = np.array(image)
    pixels[per_pixel] = MASK_GREY
    drawn = Image.fromarray(pixels)
    pen = ImageDraw.Draw(drawn)
    rows, cols = per_pixel.shape[0] // patch, per_pixel.shape[1] // patch
    blocks = per_pixel[: rows * patch, : cols * patch].reshape(rows, patch, cols, patch).mean((1, 3)) > 0.5
    for r, c in zip(*np.nonzero(blocks), strict=True):
        pen.rectangle([c * patch, r * patch, (c + 1) * patch - 1, (r + 1) * patch - 1], outline=MASK_OUTLINE)
    return drawn


MASK_VIEW_COLUMNS = ("model_input", "masked_image", "mask_content_share", "mask_missed_content")
# The legend drawn under each overlay, so the picture reads without the table's other columns: a swatch of the
# overlay's marking, the share of the content the mask covered, and the missed-content flag in red.
LEGEND_WIDTH = THUMBNAIL_PIXELS  # at least this wide, for its text; a smaller overlay sits at its top left
LEGEND_LINE_PIXELS = 12
LEGEND_FONT_PIXELS = 10
MISSED_FLAG = (220, 0, 0)


def legend_text(share: float, missed: bool) -> str:
    """The legend's second line: what the mask covered of the image's content."""
    if missed:
        return "MISSED the content"
    return "no content to cover" if share != share else f"covers {share:.0%} of content"


def with_legend(overlay: Image.Image, share: float, missed: bool) -> Image.Image:
    """``overlay`` above a white band: a grey, magenta-outlined swatch "masked (fed black)", then
    ``legend_text`` (red when the mask missed the content)."""
    from PIL import ImageFont

    font = ImageFont.load_default(size=LEGEND_FONT_PIXELS)
    width = max(overlay.width, LEGEND_WIDTH)
    canvas = Image.new("RGB", (width, overlay.height + 2 * LEGEND_LINE_PIXELS + 4), "white")
    canvas.paste(overlay, (0, 0))
    pen, top = ImageDraw.Draw(canvas), overlay.height + 2
    swatch = LEGEND_LINE_PIXELS - 3
    pen.rectangle([2, top + 1, 2 + swatch, top + 1 + swatch], fill=MASK_GREY, outline=MASK_OUTLINE)
    pen.text((swatch + 6, top), "masked (fed black)", fill="black", font=font)
    colour = MISSED_FLAG if missed else "black"
    pen.text((2, top + LEGEND_LINE_PIXELS), legend_text(share, missed), fill=colour, font=font)
    return canvas


def content_pixels(image: Image.Image) -> np.ndarray:
    """A bool per pixel: the pixel differs from the image's most common colour (its background; black in the shapes
    testbed), so it carries what the image shows."""
    pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    colours, counts = np.unique(pixels, axis=0, return_counts=True)
    background = colours[counts.argmax()]
    return (pixels != background).any(1).reshape(image.size[1], image.size[0])


def mask_views(trainer, image: Image.Image, selection: torch.Tensor | None) -> dict[str, Any]:
    """What a row shows of its mask: ``model_input``, the pixels the model received (masked patches black, as the
    processor's normalised black); ``masked_image``, the same mask drawn grey with a magenta outline, which shows on
    a black background too; ``mask_content_share``, the share of the image's content pixels the mask covered (0: it
    missed everything the image shows, and the row's perception KL measures nothing). Empty where the mask is
    unknown or cannot be drawn."""
    if selection is None:
        return {}
    found = mask_pixels(trainer, image, selection)
    if found is None:
        return {}
    resized, per_pixel = found
    patch = trainer.masks.patch_size() if trainer.args.mask_type != "random" else per_pixel.shape[0]
    if trainer.args.mask_type == "merge_unit":
        patch *= getattr(trainer.processing_class.image_processor, "merge_size", 1)
    return mask_rendering(resized, per_pixel, patch)


def mask_rendering(image: Image.Image, per_pixel: np.ndarray, patch: int) -> dict[str, Any]:
    """The ``MASK_VIEW_COLUMNS`` of one masked image, in the training table and the held-out tables alike: ``image``
    as the model received it (``per_pixel`` True: black), its overlay (grey, each masked ``patch`` outlined, with its
    legend underneath: ``with_legend``) and the share of its content the mask covered."""
    rgb = image.convert("RGB")
    received = np.array(rgb)
    received[per_pixel] = 0
    content = content_pixels(image)
    share = float((content & per_pixel).sum() / content.sum()) if content.any() else float("nan")
    missed = bool(content.any() and share == 0.0)
    return {
        "model_input": thumbnail(Image.fromarray(received)),
        "masked_image": with_legend(thumbnail(draw_mask(rgb, per_pixel, patch)), share, missed),
        "mask_content_share": share,
        "mask_missed_content": missed,
    }


def prompt_text(processing_class, prompt) -> str:
    """A logged prompt as text: as it is, or a conversation through the chat template (as TRL 1.9.1 logged it)."""
    if isinstance(prompt, str):
        return prompt
    return processing_class.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def item_keys(prompts: list[str], images: list) -> list[tuple[str, str]]:
    """Each row's item: its prompt text and its image's digest together."""
    return [(prompt, image_digest(images[i][0]) if images[i] else "") for i, prompt in enumerate(prompts)]


def chosen_rows(items: list[tuple[str, str]]) -> list[int]:
    """Rows of the first ``REVIEW_PROMPTS`` items, at most ``REVIEW_COMPLETIONS_PER_PROMPT`` completions each, in
    the generation batch's order."""
    by_item: dict[tuple[str, str], list[int]] = {}
    for i, key in enumerate(items):
        if key in by_item or len(by_item) < REVIEW_PROMPTS:
            rows = by_item.setdefault(key, [])
            if len(rows) < REVIEW_COMPLETIONS_PER_PROMPT:
                rows.append(i)
    return [i for rows in by_item.values() for i in rows]


def row_mask(masks: dict[int, torch.Tensor], items: list[tuple[str, str]], i: int) -> torch.Tensor | None:
    """The selection row ``i`` trained with: its own, or, where the masked branch masked one row per prompt (the
    shared prompt prefix) and applied it to the prompt's other rows, that row's."""
    if i in masks:
        return masks[i]
    return next((masks[j] for j, key in enumerate(items) if key == items[i] and j in masks), None)


def completions_table(trainer, step: int) -> pd.DataFrame:
    """The latest rollouts TRL keeps (``trainer._logs``) for the first ``REVIEW_PROMPTS`` items, each row with its
    own image, mask, rewards, advantage and perception terms (this process's rows only, as the trainer keeps)."""
    logs = trainer._logs
    # TRL up to 1.13 keeps each prompt's text; later releases keep the prompt itself (a conversation): its text then
    prompts = [prompt_text(trainer.processing_class, prompt) for prompt in logs["prompt"]]
    completions = list(logs["completion"])
    images = list(logs["images"]) if len(logs["images"]) == len(prompts) else [None] * len(prompts)
    rewards = {name: list(values) for name, values in logs["rewards"].items()}
    extra = {name: list(values) for name, values in logs["extra"].items() if len(values) == len(prompts)}
    advantages = list(logs["advantages"])
    papo = hasattr(trainer, "perception_record")  # a GRPOTrainer keeps neither
    perception = trainer.perception_record.rollout if papo else {}
    skipped = papo and trainer.masked_branch.skipped
    masks = trainer.masks.rollout_masks if papo else {}
    vppo = getattr(trainer, "rollout_review", None)  # a VPPOTrainer's per-completion dependency, kept share, scale
    local_rows = len(prompts) // max(trainer.accelerator.num_processes, 1)  # rank 0's rows come first
    items = item_keys(prompts[:local_rows], images[:local_rows])
    table = []
    for i in chosen_rows(items):
        first = (images[i] or [None])[0]
        row: dict[str, Any] = {"step": step, "row": i, "item": image_digest(first) if first is not None else ""}
        row.update({name: values[i] for name, values in extra.items()})
        if first is not None:
            row["image"] = thumbnail(first)
            row.update(mask_views(trainer, first, row_mask(masks, items, i)))
        row.update(prompt=prompts[i], completion=completions[i])
        row.update({f"reward/{name}": float(values[i]) for name, values in rewards.items()})
        kl, entropy, masked_entropy = perception.get(i, (None, None, None))
        if skipped:  # the masked branch did not run: its KL and entropy would be the original branch's, not measured
            kl, masked_entropy = None, None
        row.update(advantage=float(advantages[i]), perception_kl=kl)
        row.update(original_entropy=entropy, masked_entropy=masked_entropy)
        if vppo is not None:
            row.update(zip(VPPO_COLUMNS, vppo.get(i, (None,) * len(VPPO_COLUMNS)), strict=True))
        table.append(row)
    frame = pd.DataFrame(table)
    views = [column for column in MASK_VIEW_COLUMNS if column in frame]
    if views and frame[views].isna().any().any():
        frame = frame.drop(columns=views)  # log_table refuses a column of images and blanks
    return frame


def log_completions(client: MlflowClient, run_id: str, trainer, step: int) -> dict[str, Any]:
    """Append ``completions_table`` to the run's table; returns what it cost (rows, images, pixels, seconds)."""
    start = time.perf_counter()
    table = completions_table(trainer, step)
    if table.empty:
        return {"rows": 0, "images": 0, "pixels": 0, "seconds": time.perf_counter() - start}
    pictures = [cell for column in ("image", "masked_image") if column in table for cell in table[column]]
    client.log_table(run_id, data=table, artifact_file=TABLE_FILE)  # (it replaces the images by file references)
    return {
        "rows": len(table),
        "images": len(pictures),
        "pixels": sum(p.width * p.height for p in pictures),
        "seconds": time.perf_counter() - start,
    }
