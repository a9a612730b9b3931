"""A researcher's own rows (``dataset_schema: shapes`` with a hub id or local folder; the schema is docs/data.md):
checked row by row before any model loads, images kept within ``min_pixels``/``max_pixels`` and over-long prompts
dropped, exactly as the official schema does it (``recipe.data``: the same resize, processor bounds and filter).

A row holds ``prompt`` (plain text with ``<image>`` placeholders, or TRL's conversational messages), ``image`` (one
image) or ``images`` (a list), ``answer`` (the reward's ground truth), and any further columns, which reach the
reward functions as keyword arguments. Images may be stored as images or as file paths.
"""

from __future__ import annotations

import io

import datasets
from PIL import Image

from papo_nb.workbook.recipe.data import (
    RecipeDataError,
    bounded_processor,
    filter_overlong_prompts,
    load_rows,
    log_filter_report,
    resize_to_pixel_bounds,
    user_message,
)

IMAGE_COLUMNS = ("image", "images")
EXPECTED_PROMPT = (
    "plain text with one '<image>' per image (none: the images go first), or TRL's conversational messages "
    "[{'role': 'user', 'content': [{'type': 'image'}, {'type': 'text', 'text': ...}]}] with one image part per image"
)


def image_column(dataset: datasets.Dataset, where: str) -> str:
    """The row's image column, ``image`` or ``images`` (one of them, not both)."""
    present = [c for c in IMAGE_COLUMNS if c in dataset.column_names]
    if len(present) != 1:
        raise RecipeDataError(
            f"{where}: needs exactly one image column, 'image' (one image per row) or 'images' (a list per row); "
            f"it has {dataset.column_names}"
        )
    return present[0]


def _open_image(stored) -> Image.Image:
    """An image stored as a PIL image, ``{'bytes', 'path'}`` (datasets' undecoded form) or a file path, decoded."""
    if isinstance(stored, Image.Image):
        image = stored
    elif isinstance(stored, dict):
        image = Image.open(io.BytesIO(stored["bytes"]) if stored.get("bytes") else stored["path"])
    else:
        image = Image.open(stored)
    image.load()  # a truncated or corrupt file fails here, at its row, not in the middle of training
    return image


def _prompt_images(prompt) -> int | None:
    """Image parts a conversational prompt holds; None when no content is structured (TRL puts the images first)."""
    contents = [m.get("content") for m in prompt]
    if all(isinstance(c, str) for c in contents):
        return None
    return sum(1 for c in contents if isinstance(c, list) for part in c if part.get("type") == "image")


def conversational_prompt(prompt, n_images: int) -> list[dict]:
    """``prompt`` as structured conversational messages with ``n_images`` image parts, or RecipeDataError saying
    what is expected. Plain text is split at ``<image>`` (recipe.data.user_message); messages whose contents are
    all strings get the images in front of the first user turn, as TRL's ``prepare_multimodal_messages`` does."""
    if isinstance(prompt, str):
        return user_message(prompt, n_images)
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise RecipeDataError(f"got {type(prompt).__name__} {str(prompt)[:80]!r}; expected {EXPECTED_PROMPT}")
    parts = _prompt_images(prompt)
    if parts is not None and parts != n_images:
        raise RecipeDataError(f"{parts} image part(s) but {n_images} image(s); expected {EXPECTED_PROMPT}")
    if parts is not None:
        return prompt
    messages, placed = [], False
    for message in prompt:
        content = [{"type": "text", "text": message["content"]}]
        if message["role"] == "user" and not placed:
            content = [{"type": "image", "text": None}] * n_images + content
            placed = True
        messages.append({"role": message["role"], "content": content})
    return messages


def own_rows(
    dataset: datasets.Dataset, where: str, min_pixels: int, max_pixels: int, limit: int | None = None
) -> datasets.Dataset:
    """Checked and converted rows: prompts conversational, images decoded and resized into the pixel bounds (the
    official ``process_image``), ``answer`` a string; other columns kept. RecipeDataError names the row and column
    of the first row that does not fit (``where`` names the parameter and split)."""
    missing = [c for c in ("prompt", "answer") if c not in dataset.column_names]
    if missing:
        raise RecipeDataError(
            f"{where}: missing column(s) {missing}; own rows need 'prompt', 'image' or 'images', and 'answer' "
            f"(docs/data.md); it has {dataset.column_names}"
        )
    column = image_column(dataset, where)
    undecoded = datasets.List(datasets.Image(decode=False)) if column == "images" else datasets.Image(decode=False)
    dataset = dataset.cast_column(column, undecoded)  # decoded below, row by row, so a bad file names its row
    dataset = dataset.cast_column("answer", datasets.Value("string"))  # the rewards compare text (3 -> "3")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))

    def convert(row, index):
        stored = row[column] if column == "images" else [row[column]]
        try:
            images = [resize_to_pixel_bounds(_open_image(s), min_pixels, max_pixels) for s in stored or []]
        except Exception as exc:
            raise RecipeDataError(
                f"{where}, row {index}, column {column!r}: unreadable image ({type(exc).__name__}: {exc}); "
                "expected an image or the path of an image file"
            ) from None
        if row["answer"] is None:
            raise RecipeDataError(f"{where}, row {index}, column 'answer': empty; expected the reward's ground truth")
        try:
            prompt = conversational_prompt(row["prompt"], len(images))
        except RecipeDataError as exc:
            raise RecipeDataError(f"{where}, row {index}, column 'prompt': {exc}") from None
        return {"prompt": prompt, column: images if column == "images" else images[0], "answer": str(row["answer"])}

    converted = dataset.map(convert, with_indices=True, desc="own rows: checked, pixel bounds")
    return converted.cast_column(column, datasets.List(datasets.Image()) if column == "images" else datasets.Image())


def own_datasets(params, model_path: str):
    """(train rows, held-out rows) of the own rows in ``params.dataset``: splits ``train_split`` and ``eval_split``
    (the first ``n_train_prompts`` and ``n_eval_prompts`` rows), checked, bounded and filtered; the filter's counts
    are printed and, inside an MLflow run, logged as ``data/train/...`` and ``data/validation/...``, as the
    official schema's."""
    processor = bounded_processor(params, model_path)
    prepared = []
    for parameter, split, limit in (
        ("train_split", params.train_split, params.n_train_prompts),
        ("eval_split", params.eval_split, params.n_eval_prompts),
    ):
        where = f"parameter 'dataset' = {params.dataset!r} ({parameter} {split!r})"
        raw = load_rows(params.dataset, split, "dataset", split_parameter=parameter)
        rows = own_rows(raw, where, params.min_pixels, params.max_pixels, limit)
        kept, report = filter_overlong_prompts(rows, processor, params.max_prompt_length)
        log_filter_report("train" if parameter == "train_split" else "validation", report)
        prepared.append(kept)
    return tuple(prepared)
