"""The official PAPO data: hub ids, the ``problem``/``answer``/``images`` schema, pixel bounds, format prompt, and
over-long prompt filtering, turned into TRL's conversational VLM rows.

Follows MikeWangWZHL/PAPO at fb63bf4: ``examples/configs/config_grpo_papo.yaml`` (``cfg``) and
``verl/utils/dataset.py`` (``ds``):

- training data ``PAPOGalaxy/PAPO_ViRL39K_train``, validation ``PAPOGalaxy/PAPO_MMK12_test`` (cfg:2-3);
- columns ``problem``, ``answer``, ``images`` (cfg:4-6); ``id@split`` picks a split, default ``train`` (ds:130-133);
- each image resized on the PIL side into ``[min_pixels, max_pixels]`` = 256 and 1280 28x28 patches
  (cfg:19-20, ds:57-81); the same bounds are set on the processor so its own resize keeps them;
- the format prompt ``examples/format_prompt/math_perception.jinja`` rendered with ``content`` = the problem
  (cfg:15, ds:270-272); ``<image>`` in the text marks where each image goes (ds:274-284);
- prompts longer than ``max_prompt_length`` tokens (images included) dropped (cfg:21, ds:154-159, ds:298-311).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import datasets
from jinja2 import Template
from PIL import Image

from papo_nb.workbook.config.params import ParamsError

TRAIN_DATASET = "PAPOGalaxy/PAPO_ViRL39K_train"  # cfg:2, README.md:73
VALIDATION_DATASET = "PAPOGalaxy/PAPO_MMK12_test"  # cfg:3, README.md:74
# The eight evaluation benchmarks (one split each); note the org is spelled "PAPO-Galaxy" here (README.md:78,
# PAPO-Eval papo_eval/preprocess/preprocess.sh:8).
EVAL_DATASET = "PAPO-Galaxy/PAPO_eval"
OFFICIAL_COLUMNS = ("problem", "answer", "images")  # cfg:4-6
IMAGE_PLACEHOLDER = "<image>"  # ds:277
PATCH_PIXELS = 28 * 28  # one merged Qwen2.5-VL patch (2x2 of 14x14)
MIN_PIXELS = 256 * PATCH_PIXELS  # cfg:20, 200704
MAX_PIXELS = 1280 * PATCH_PIXELS  # cfg:19, 1003520
MAX_PROMPT_LENGTH = 4096  # *_grpo_papo.sh:17 MAX_PROMPT_LENGTH=4096 (also cfg:10)

# examples/format_prompt/math_perception.jinja, verbatim (3 lines; the file's SHA-256 is FORMAT_PROMPT_SHA256).
FORMAT_PROMPTS = {
    "math_perception": "{{ content | trim }}\n\nYou first think through the reasoning process as an internal "
    "monologue, enclosed within <think> </think> tags. Then, provide your final answer enclosed within \\boxed{}.",
    "none": "{{ content }}",
}
FORMAT_PROMPT_SHA256 = "4b204150d4cf07cdc787390b4fc8a494150c417dc386990c4f456e792318fa60"


class RecipeDataError(ParamsError):
    """The data does not fit the official recipe; the message names the parameter and what to change."""


def format_template(format_prompt: str) -> Template:
    """A named format prompt (``math_perception``, ``none``) or the path of a jinja file with ``{{ content }}``."""
    return compiled_template(format_source(format_prompt))


@functools.lru_cache(maxsize=8)
def compiled_template(source: str) -> Template:
    """One compiled template per process (jinja templates do not pickle; a worker compiles its own)."""
    return Template(source)


def format_source(format_prompt: str) -> str:
    """The template text of a named format prompt or a jinja file, stripped as ds:271 strips it."""
    if format_prompt in FORMAT_PROMPTS:
        return FORMAT_PROMPTS[format_prompt].strip()
    path = Path(format_prompt).expanduser()
    if not path.is_file():
        raise RecipeDataError(
            f"parameter 'format_prompt' = {format_prompt!r}: not a named prompt ({', '.join(FORMAT_PROMPTS)}) "
            "nor an existing jinja file"
        )
    return path.read_text(encoding="utf-8").strip()


def resize_to_pixel_bounds(image: Image.Image, min_pixels: int | None, max_pixels: int | None) -> Image.Image:
    """The official ``process_image`` (ds:57-81): scale down above ``max_pixels``, up below ``min_pixels``, RGB."""
    if max_pixels is not None and image.width * image.height > max_pixels:
        factor = math.sqrt(max_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    if min_pixels is not None and image.width * image.height < min_pixels:
        factor = math.sqrt(min_pixels / (image.width * image.height))
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    return image.convert("RGB") if image.mode != "RGB" else image


def set_processor_pixel_bounds(processor, min_pixels: int, max_pixels: int) -> None:
    """Make the processor's own smart resize keep images within ``[min_pixels, max_pixels]`` (the official
    ``min_pixels``/``max_pixels``; transformers 5 spells them ``size.shortest_edge``/``size.longest_edge``)."""
    from transformers.image_processing_utils import SizeDict

    if not 0 < min_pixels <= max_pixels:
        raise RecipeDataError(
            f"parameters 'min_pixels' = {min_pixels} and 'max_pixels' = {max_pixels}: "
            "need 0 < min_pixels <= max_pixels"
        )
    processor.image_processor.size = SizeDict(shortest_edge=min_pixels, longest_edge=max_pixels)


def bounded_processor(params, model_path: str):
    """The model's processor with the run's pixel bounds: what the prompt-length filter counts with."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    set_processor_pixel_bounds(processor, params.min_pixels, params.max_pixels)
    return processor


def processor_pixel_bounds(processor) -> tuple[int, int]:
    size = processor.image_processor.size
    return int(size.shortest_edge), int(size.longest_edge)


def user_message(text: str, n_images: int) -> list[dict]:
    """One user turn split at ``<image>`` into text and image parts (ds:274-284). A problem without placeholders
    gets its images in front of the text (TRL's and Qwen's convention); any other mismatch is an error."""
    placeholders = text.count(IMAGE_PLACEHOLDER)
    if placeholders == 0 and n_images:
        text = IMAGE_PLACEHOLDER * n_images + text
    elif placeholders != n_images:
        raise RecipeDataError(
            f"the text has {placeholders} '<image>' placeholders but {n_images} images: {text[:80]!r}"
        )
    content = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            content.append({"type": "image", "text": None})
        if piece:
            content.append({"type": "text", "text": piece})
    return [{"role": "user", "content": content}]


def load_rows(
    name_or_path: str, split: str = "train", parameter: str = "dataset", split_parameter: str = ""
) -> datasets.Dataset:
    """One split of a hub id (``id`` or ``id@split``), a ``save_to_disk`` folder (a DatasetDict's named split; a
    single Dataset is every split), or a parquet/json file or folder, schema unchecked. Hub ids go through
    ``datasets.load_dataset`` (ds:143-145); nothing here is mocked. ``split_parameter`` names the parameter that chose
    ``split``, for the error when the data lacks it."""
    if "@" in name_or_path:
        name_or_path, split = name_or_path.split("@", 1)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                chosen = f" (parameter {split_parameter!r})" if split_parameter else ""
                raise RecipeDataError(
                    f"parameter {parameter!r} = {name_or_path!r} has splits {sorted(loaded)}, not {split!r}{chosen}"
                )
            loaded = loaded[split]
    elif path.is_dir():  # a folder of data files (ds:135-138)
        file_type = os.path.splitext(sorted(os.listdir(path))[0])[-1][1:].replace("jsonl", "json")
        loaded = datasets.load_dataset(file_type, data_dir=str(path), split=split)
    elif path.is_file():  # one data file (ds:139-141)
        file_type = path.suffix[1:].replace("jsonl", "json")
        loaded = datasets.load_dataset(file_type, data_files=str(path), split="train")
    elif name_or_path.startswith(("/", ".", "~")):
        raise RecipeDataError(f"parameter {parameter!r} = {name_or_path!r}: no such file or folder")
    else:
        loaded = datasets.load_dataset(name_or_path, split=split)
    return loaded


def load_official_dataset(name_or_path: str, split: str = "train", parameter: str = "dataset") -> datasets.Dataset:
    """``load_rows`` in the official schema (its columns checked)."""
    loaded = load_rows(name_or_path, split, parameter)
    name_or_path, _, chosen_split = name_or_path.partition("@")
    split = chosen_split or split
    missing = [c for c in OFFICIAL_COLUMNS if c not in loaded.column_names]
    if missing:
        raise RecipeDataError(
            f"parameter {parameter!r} = {name_or_path!r} (split {split!r}) lacks column(s) {missing}: the official "
            f"schema is {list(OFFICIAL_COLUMNS)} (problem: str with '<image>' placeholders, answer: str, images: list "
            f"of images); it has {loaded.column_names}"
        )
    return loaded


def to_trl_rows(dataset: datasets.Dataset, format_prompt: str, min_pixels: int, max_pixels: int) -> datasets.Dataset:
    """Official rows -> TRL rows: ``prompt`` (one user turn, the format prompt applied), ``images`` (resized into the
    pixel bounds), ``answer`` (the reward's ground truth)."""
    source = format_source(format_prompt)

    def convert(row):
        images = [resize_to_pixel_bounds(img, min_pixels, max_pixels) for img in row["images"] or []]
        text = compiled_template(source).render(content=row["problem"])
        return {"prompt": user_message(text, len(images)), "images": images, "answer": str(row["answer"])}

    # One process: datasets' workers are forked, and a fork after the image processor's torch threads have run can
    # hang (it did in the test suite); the official code uses 16 workers for its filter (ds:113-114).
    return dataset.map(convert, remove_columns=dataset.column_names, desc="official schema -> TRL rows")


def row_images(row: dict) -> list:
    """A row's images: its ``images`` list, or its one ``image`` (own rows may use either column, as TRL does)."""
    if "images" in row:
        return list(row["images"] or [])
    return [] if row.get("image") is None else [row["image"]]


def prompt_length(processor, row: dict) -> int:
    """Tokens of the chat-templated prompt, images expanded, as the official filter counts them (ds:298-311)."""
    text = processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    images = row_images(row) or None
    return int(
        processor(images=images, text=[text], add_special_tokens=False, return_tensors="pt")["input_ids"].shape[-1]
    )


@dataclass
class FilterReport:
    kept: int
    dropped: int
    longest_kept: int

    def to_dict(self) -> dict:
        return {"kept": self.kept, "dropped_overlong": self.dropped, "longest_kept_prompt_tokens": self.longest_kept}


def log_filter_report(split: str, report: FilterReport) -> None:
    """Inside an MLflow run, the filter's counts as ``data/<split>/...`` metrics."""
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.log_metrics({f"data/{split}/{k}": float(v) for k, v in report.to_dict().items()})


def filter_overlong_prompts(dataset: datasets.Dataset, processor, max_prompt_length: int):
    """Drop rows (official or own, ``row_images``) whose prompt is longer than ``max_prompt_length`` tokens
    (cfg:21); returns (dataset, report)."""
    counted = dataset.map(lambda row: {"prompt_tokens": prompt_length(processor, row)}, desc="prompt lengths")
    lengths = counted["prompt_tokens"]
    keep = [i for i, n in enumerate(lengths) if n <= max_prompt_length]
    report = FilterReport(len(keep), len(lengths) - len(keep), max((lengths[i] for i in keep), default=0))
    print(f"over-long prompts (> {max_prompt_length} tokens): dropped {report.dropped} of {len(lengths)}")
    return dataset.select(keep), report


def prepare_split(
    source,
    processor,
    *,
    format_prompt: str,
    min_pixels: int,
    max_pixels: int,
    max_prompt_length: int,
    limit: int | None = None,
    parameter: str = "dataset",
    split: str = "train",
):
    """Load (or take) one split in the official schema and make it TRL-ready; returns (dataset, filter report)."""
    raw = source if isinstance(source, datasets.Dataset) else load_official_dataset(source, split, parameter)
    if limit is not None:
        raw = raw.select(range(min(limit, len(raw))))
    rows = to_trl_rows(raw, format_prompt, min_pixels, max_pixels)
    return filter_overlong_prompts(rows, processor, max_prompt_length)


EVAL_SEED_OFFSET = 10_000  # as builder: held-out synthetic rows come from their own stream


def official_datasets(params, model_path: str):
    """(train rows, held-out rows) for ``dataset_schema='official'``: ``dataset`` (a hub id such as
    ``PAPOGalaxy/PAPO_ViRL39K_train``, a local copy, or ``synthetic`` for the local official-schema set) and
    ``validation_dataset`` (empty only with ``synthetic``, which draws held-out rows from another seed). The filter
    counts are printed and, inside an MLflow run, logged as ``data/<split>/...`` metrics."""
    from papo_nb.testbed.official_schema import make_official_schema_dataset

    if not params.validation_dataset and params.dataset != "synthetic":
        raise RecipeDataError(
            f"parameter 'validation_dataset' is empty with dataset = {params.dataset!r}: name the held-out set "
            f"(official: {VALIDATION_DATASET}); only dataset 'synthetic' draws held-out rows of its own"
        )
    processor = bounded_processor(params, model_path)
    options = dict(
        format_prompt=params.format_prompt,
        min_pixels=params.min_pixels,
        max_pixels=params.max_pixels,
        max_prompt_length=params.max_prompt_length,
    )
    sources = {
        "train": (params.dataset, params.n_train_prompts, params.seed, "dataset"),
        "validation": (
            params.validation_dataset or params.dataset,
            params.n_eval_prompts,
            params.seed + EVAL_SEED_OFFSET,
            "validation_dataset",
        ),
    }
    prepared = []
    for split, (source, limit, seed, parameter) in sources.items():
        if source == "synthetic":
            source = make_official_schema_dataset(limit, seed=seed)
        rows, report = prepare_split(source, processor, limit=limit, parameter=parameter, **options)
        log_filter_report(split, report)
        prepared.append(rows)
    return tuple(prepared)
