"""The recipe data estimate behind notebook and test use: the processor's pixel bounds, the dataset's columns and an
estimate of the steps and tokens from a sample of real prompt lengths. The command is ``papo-nb preflight``
(``papo_nb.workbook.recipe.check``); this module no longer runs as one.

Every problem names the parameter, its value and what to change. The estimate is arithmetic on the recipe, the
dataset's length and a sample of real prompt lengths; the memory figure is a lower bound (weights, gradients,
AdamW states, the reference copy and one micro-batch of completion logits; activations and the KV cache come on top).
The forecast of every part, for every schema, is ``forecast`` (``papo-nb preflight``), which ``papo-nb train`` and
``papo-nb run`` apply on ``device: cuda`` before any weight loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from papo_nb.workbook.config.batch_layout import batch_deviations, batch_layout, check_batches
from papo_nb.workbook.recipe.data import OFFICIAL_COLUMNS, PATCH_PIXELS, processor_pixel_bounds, prompt_length
from papo_nb.workbook.recipe.presets import recipe_deviations

GIB = 1024**3
MEMORY_HEADROOM = 0.85  # fraction of a GPU the lower bound may take; the rest is activations and the KV cache


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)  # from the named recipe: allowed, reported and logged
    estimates: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            raise ValueError("recipe preflight failed:\n- " + "\n- ".join(self.problems))


def parameter_count(model_name_or_path: str) -> int:
    """Parameters of the model, counted on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_name_or_path)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


def memory_lower_bound(params, n_params: int, vocab_size: int) -> float:
    """Bytes per GPU: weights, gradients and two AdamW states in the training dtype for full fine-tuning (sharded
    over the processes under FSDP), the frozen weights alone for LoRA, a reference copy when beta > 0 and full
    fine-tuning, and one micro-batch of completion logits (bf16 logits plus their fp32 log-softmax)."""
    width = 2 if params.precision == "bf16" else 4
    shards = params.num_processes if "fsdp" in params.accelerate_config.lower() else 1
    if params.finetuning == "full":
        state = n_params * width * 4 / shards
        reference = n_params * width / shards if params.beta > 0 else 0.0
    else:
        state, reference = n_params * width, 0.0
    logits = params.per_device_train_batch_size * params.max_completion_length * vocab_size * (width + 4)
    return state + reference + logits


def check_gpus(params, n_params: int, vocab_size: int, gpus: list[int] | None = None) -> tuple[list[str], dict]:
    """``gpus`` is the memory of each visible GPU in bytes (None: ask torch)."""
    if gpus is None:
        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    need = memory_lower_bound(params, n_params, vocab_size)
    estimates = {"gpus": len(gpus), "gpu_memory_gib": min(gpus, default=0) / GIB, "memory_lower_bound_gib": need / GIB}
    problems = []
    if params.device != "cpu" and len(gpus) < params.num_processes:
        problems.append(
            f"parameter 'num_processes' = {params.num_processes}: {len(gpus)} GPU(s) here; set num_processes <= "
            f"{len(gpus)} and multiply gradient_accumulation_steps and steps_per_generation by the same factor to "
            "keep the batches"
        )
    if gpus and need > MEMORY_HEADROOM * min(gpus):
        problems.append(
            f"parameter 'per_device_train_batch_size' = {params.per_device_train_batch_size} (finetuning = "
            f"{params.finetuning!r}): needs at least {need / GIB:.1f} GiB per GPU before activations, "
            f"{MEMORY_HEADROOM:.0%} of {min(gpus) / GIB:.1f} GiB is available; lower per_device_train_batch_size "
            "(raise gradient_accumulation_steps to keep the batch), shard with an FSDP accelerate_config, or use "
            "finetuning='lora'"
        )
    return problems, estimates


def check_dataset(params, dataset) -> list[str]:
    missing = [c for c in OFFICIAL_COLUMNS if c not in dataset.column_names]
    if missing:
        return [
            f"parameter 'dataset' = {params.dataset!r}: missing column(s) {missing}; the official schema is "
            f"{list(OFFICIAL_COLUMNS)}"
        ]
    return []


def check_processor(params, processor, max_images_per_row: int) -> list[str]:
    problems = []
    bounds = processor_pixel_bounds(processor)
    if bounds != (params.min_pixels, params.max_pixels):
        problems.append(
            f"processor pixel bounds {bounds} differ from parameters 'min_pixels'/'max_pixels' = "
            f"({params.min_pixels}, {params.max_pixels}); set them with recipe_data.set_processor_pixel_bounds"
        )
    image_tokens = max_images_per_row * params.max_pixels // PATCH_PIXELS
    if image_tokens >= params.max_prompt_length:
        problems.append(
            f"parameter 'max_pixels' = {params.max_pixels}: {max_images_per_row} image(s) of that size take "
            f"{image_tokens} tokens, not below max_prompt_length = {params.max_prompt_length}; lower max_pixels or "
            "raise max_prompt_length"
        )
    return problems


def estimate_run(params, rows, processor, layout: dict, sample: int = 32, total_rows: int | None = None) -> dict:
    """Optimizer steps per epoch of ``total_rows`` (default: all of ``rows``), the epochs ``max_steps`` covers, and
    the tokens generated and read (from a sample of real prompt lengths)."""
    lengths = [prompt_length(processor, rows[i]) for i in range(min(sample, len(rows)))]
    mean_prompt = sum(lengths) / max(len(lengths), 1)
    # Incomplete rounds are dropped, by TRL's RepeatSampler (trl/trainer/utils.py:775-779) as by the official
    # loader (drop_last, verl/trainer/data_loader.py:66).
    total_rows = len(rows) if total_rows is None else total_rows
    generations_per_epoch = int(total_rows // layout["prompts_per_generation"])
    steps_per_epoch = generations_per_epoch * layout["optimizer_steps_per_generation"]
    epochs = params.max_steps / steps_per_epoch if steps_per_epoch else math.inf
    prompts_seen = params.max_steps * layout["prompts_per_optimizer_step"]
    return {
        "rows": total_rows,
        "optimizer_steps_per_epoch": steps_per_epoch,
        "epochs_at_max_steps": epochs,
        "mean_prompt_tokens_sampled": mean_prompt,
        "completion_tokens_at_most": prompts_seen * params.num_generations * params.max_completion_length,
        "prompt_tokens_read": prompts_seen * params.num_generations * mean_prompt,
    }


def preflight(
    params, rows, processor, raw_dataset=None, *, n_params: int, vocab_size: int, gpus=None, total_rows=None
) -> PreflightReport:
    """All checks; ``rows`` are the TRL-ready training rows (or a sample of ``total_rows``), ``raw_dataset`` the
    official-schema source."""
    report = PreflightReport()
    layout = batch_layout(params)
    report.estimates.update(layout)
    report.problems += check_batches(params, layout)
    report.deviations += batch_deviations(params, layout)
    report.deviations += [
        f"parameter {k!r} = {mine!r}, recipe {params.recipe!r}: {theirs!r}"
        for k, (mine, theirs) in recipe_deviations(params).items()
    ]
    gpu_problems, gpu_estimates = check_gpus(params, n_params, vocab_size, gpus)
    report.problems += gpu_problems
    report.estimates.update(gpu_estimates)
    if raw_dataset is not None:
        report.problems += check_dataset(params, raw_dataset)
    max_images = max((len(images) for images in rows["images"]), default=1)
    report.problems += check_processor(params, processor, max_images)
    if len(rows) == 0:
        report.problems.append(
            f"parameter 'max_prompt_length' = {params.max_prompt_length}: every prompt is longer; raise it"
        )
    else:
        report.estimates.update(estimate_run(params, rows, processor, layout, total_rows=total_rows))
        if report.estimates["optimizer_steps_per_epoch"] == 0:
            report.problems.append(
                f"parameter 'n_train_prompts' = {params.n_train_prompts}: {report.estimates['rows']} rows after "
                f"filtering, fewer than one rollout round of {layout['prompts_per_generation']:g} prompts; use more "
                "rows or lower steps_per_generation"
            )
    return report


def run(params, gpus: list[int] | None = None, sample_rows: int = 256) -> PreflightReport:
    """Preflight from params alone: the processor and model config (no weights), the first ``sample_rows`` rows of
    the training data through the real loader; the step estimate scales to ``n_train_prompts`` or the data's size."""
    from transformers import AutoConfig, AutoProcessor

    from papo_nb.testbed.official_schema import make_official_schema_dataset
    from papo_nb.workbook.config.paths import resolve_model_path
    from papo_nb.workbook.recipe.data import load_official_dataset, prepare_split, set_processor_pixel_bounds

    if params.dataset_schema != "official":
        return PreflightReport(
            problems=["parameter 'dataset_schema' = 'shapes': the recipe preflight needs 'official'"]
        )
    model_path = resolve_model_path(params)
    processor = AutoProcessor.from_pretrained(model_path)
    set_processor_pixel_bounds(processor, params.min_pixels, params.max_pixels)
    if params.dataset == "synthetic":
        raw = make_official_schema_dataset(min(params.n_train_prompts, sample_rows), seed=params.seed)
    else:
        raw = load_official_dataset(params.dataset)
    total = min(len(raw), params.n_train_prompts)
    rows, report_filter = prepare_split(
        raw.select(range(min(total, sample_rows))),
        processor,
        format_prompt=params.format_prompt,
        min_pixels=params.min_pixels,
        max_pixels=params.max_pixels,
        max_prompt_length=params.max_prompt_length,
    )
    config = AutoConfig.from_pretrained(model_path)
    vocab = getattr(config, "vocab_size", None) or config.text_config.vocab_size
    kept_fraction = report_filter.kept / max(report_filter.kept + report_filter.dropped, 1)
    expected = round(total * kept_fraction)  # the sample's filter rate applied to every row
    report = preflight(
        params, rows, processor, raw, n_params=parameter_count(model_path), vocab_size=vocab, gpus=gpus,
        total_rows=expected,
    )  # fmt: skip
    report.estimates["rows_in_source"] = total
    return report
