"""The official evaluation protocol: avg@k at temperature 1.0 and greedy accuracy per benchmark, per group (general
versus vision-dependent) and overall, each beside the same score on masked images (the perception-reliance gap).

Sources (MikeWangWZHL/PAPO at fb63bf4 and its PAPO-Eval submodule, xhguo7/PAPO-Eval):

- benchmarks: one split each of ``PAPO-Galaxy/PAPO_eval`` (README.md:76-78; split names from PAPO-Eval
  ``papo_eval/preprocess/preprocess.sh:83-85``); groups from ``data/DATA.md:9-20``. PAPO-Eval's own
  ``run_eval.py:17-28`` pools only three files for its vision-dependent number; the groups here follow DATA.md;
- avg@8 at temperature 1.0 (README.md:92; ``config_grpo_papo.yaml:92-94``), top_p 1.0 and up to 2048 new tokens
  (PAPO-Eval ``run_infer.sh:29-37``); the score is the mean over prompts of the mean over the k samples
  (``run_eval.py:66-90``), graded with mathruler's boxed-answer check (``eval_utils.py:8-11``);
- the masked condition uses the training mask on raw images (``raw_masks.mask_pil_squares``, 14-px squares).

The PAPO_eval splits are stored in LLaMA-Factory's ShareGPT form (``messages`` + ``images`` paths; PAPO-Eval
``data/dataset_info.json:72-85``); ``load_benchmark`` turns those, or rows already in the training schema, into the
official ``problem``/``answer``/``images`` schema.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean

import datasets
import torch
from PIL import Image

from papo_nb.testbed.generation import generate_answers
from papo_nb.testbed.raw_masks import mask_images
from papo_nb.workbook.config.metric_keys import HELDOUT_ACCURACY
from papo_nb.workbook.evaluation import eval_review
from papo_nb.workbook.evaluation.checkpoint_source import resolve_eval_checkpoint
from papo_nb.workbook.recipe.data import EVAL_DATASET, RecipeDataError, load_official_dataset
from papo_nb.workbook.recipe.reward import math_accuracy_reward

GENERAL, VISION_DEPENDENT = "general", "vision_dependent"
GROUPS = (GENERAL, VISION_DEPENDENT)
# The eight benchmarks (split name -> group); PAPO_MMK12 is also a split there, and the training validation set.
OFFICIAL_BENCHMARKS = {
    "hiyouga_geometry3k": GENERAL,
    "AI4Math_MathVista": GENERAL,
    "We_Math": GENERAL,
    "AI4Math_MathVerse": GENERAL,
    "lscpku_LogicVista": VISION_DEPENDENT,
    "BUAADreamer_clevr_count_70k": VISION_DEPENDENT,
    "MMMU_MMMU_Pro": VISION_DEPENDENT,
    "AI4Math_MathVerse_vision_dependent": VISION_DEPENDENT,
}
EVAL_TEMPERATURE = 1.0  # README.md:92
EVAL_TOP_P = 1.0  # PAPO-Eval run_infer.sh:33


def parse_benchmarks(entries: list[str]) -> dict[str, str]:
    """``["split", "split:group", ...]`` -> {split: group}; a bare split must be one of the official eight."""
    parsed = {}
    for entry in entries:
        name, _, group = entry.partition(":")
        group = group or OFFICIAL_BENCHMARKS.get(name, "")
        if group not in GROUPS:
            raise RecipeDataError(
                f"parameter 'eval_benchmarks' entry {entry!r}: give 'split:group' with group one of {GROUPS}, or one "
                f"of the official splits {sorted(OFFICIAL_BENCHMARKS)}"
            )
        parsed[name] = group
    if not parsed:
        raise RecipeDataError("parameter 'eval_benchmarks' is empty; name at least one benchmark split")
    return parsed


def _sharegpt_to_official(dataset: datasets.Dataset, image_root: Path | None) -> datasets.Dataset:
    def convert(row):
        turns = {m["role"]: m["content"] for m in row["messages"]}
        images = []
        for item in row.get("images") or []:
            if isinstance(item, str):
                path = Path(item) if image_root is None else image_root / item
                item = Image.open(path).convert("RGB")
            images.append(item)
        return {"problem": turns["user"], "answer": turns["assistant"], "images": images}

    features = datasets.Features(
        {"problem": datasets.Value("string"), "answer": datasets.Value("string"), "images": [datasets.Image()]}
    )
    return dataset.map(convert, remove_columns=dataset.column_names, features=features)


def load_benchmark(source: str, split: str, image_dir: str = "") -> datasets.Dataset:
    """One benchmark split in the official schema, from ``PAPO-Galaxy/PAPO_eval`` (or any hub id / local
    ``save_to_disk`` folder) in either the training schema or the ShareGPT form; ``image_dir`` resolves image
    paths (PAPO-Eval unzips them to ``data/images``)."""
    source = source or EVAL_DATASET
    try:
        return load_official_dataset(source, split, parameter="eval_dataset")
    except RecipeDataError as exc:
        if "lacks column" not in str(exc):
            raise
    path = Path(source).expanduser()
    raw = datasets.load_from_disk(str(path))[split] if path.is_dir() else datasets.load_dataset(source, split=split)
    if "messages" not in raw.column_names:
        raise RecipeDataError(
            f"parameter 'eval_dataset' = {source!r} split {split!r}: neither the official schema (problem, answer, "
            f"images) nor ShareGPT (messages, images); it has {raw.column_names}"
        )
    return _sharegpt_to_official(raw, Path(image_dir).expanduser() if image_dir else None)


@torch.no_grad()
def score_items(
    model, processor, prompts: list, answers: list[str], images: list, *, grade, samples: int, max_new_tokens: int,
    mask_ratio: float, seed: int, batch_size: int = 8,
) -> dict[str, list[float]]:  # fmt: skip
    """Per item, on original and on masked images (``raw_masks.mask_images``): greedy accuracy and the mean accuracy
    of ``samples`` completions at temperature 1.0, top_p 1.0 (avg@k). Keys ``<greedy|avg_at_k>/<original|masked>``.
    ``grade(completions, answers)`` scores a list (a TRL accuracy reward). The sampling noise is reseeded from
    ``seed`` for each condition, so both see the same draws."""
    conditions = {"original": images, "masked": mask_images(images, mask_ratio, seed)}
    repeated = [a for a in answers for _ in range(samples)]
    was_training = model.training
    model.eval()
    per_item: dict[str, list[float]] = {}
    try:
        for condition, shown in conditions.items():
            torch.manual_seed(seed)
            completions = generate_answers(
                model, processor, prompts, shown, max_new_tokens=max_new_tokens, batch_size=batch_size,
                samples=samples, temperature=EVAL_TEMPERATURE, top_p=EVAL_TOP_P,
            )  # fmt: skip
            sampled = grade(completions, repeated)
            per_item[f"avg_at_k/{condition}"] = [
                mean(sampled[i * samples : (i + 1) * samples]) for i in range(len(answers))
            ]
            greedy = generate_answers(
                model, processor, prompts, shown, max_new_tokens=max_new_tokens, batch_size=batch_size
            )
            per_item[f"greedy/{condition}"] = grade(greedy, answers)
    finally:
        model.train(was_training)
    return per_item


def evaluate_benchmark(
    model, processor, rows: datasets.Dataset, *, samples: int, max_new_tokens: int, mask_ratio: float, seed: int,
    batch_size: int = 8, review: bool = True,
) -> dict:  # fmt: skip
    """avg@``samples`` (temperature 1.0, top_p 1.0) and greedy accuracy, on original and on masked images; a
    benchmark without rows (every prompt too long) scores NaN, which the tables print as "no items". ``review``: also
    log its held-out completions table (``eval_review.log_heldout_completions``)."""
    answers = [str(a) for a in rows["answer"]]
    if not answers:
        return {"items": 0, "samples": samples, **dict.fromkeys(SCORE_KEYS, math.nan)}
    per_item = score_items(
        model, processor, list(rows["prompt"]), answers, [list(images) for images in rows["images"]],
        grade=math_accuracy_reward, samples=samples, max_new_tokens=max_new_tokens, mask_ratio=mask_ratio, seed=seed,
        batch_size=batch_size,
    )  # fmt: skip
    if review:
        shown = rows.select(range(min(eval_review.REVIEW_ROWS, len(rows))))  # their masks are the scored ones (seeds)
        eval_review.log_heldout_completions(
            model, processor, eval_review.benchmark_name(rows), list(shown["prompt"]),
            [list(i) for i in shown["images"]], answers, grade=math_accuracy_reward, max_new_tokens=max_new_tokens,
            mask_ratio=mask_ratio, seed=seed,
        )  # fmt: skip
    scores: dict[str, float] = {"items": len(answers), "samples": samples}
    for kind in ("avg_at_k", "greedy"):
        scores[kind] = mean(per_item[f"{kind}/original"])
        scores[f"{kind}_masked"] = mean(per_item[f"{kind}/masked"])
        scores[f"gap_{kind}"] = scores[kind] - scores[f"{kind}_masked"]
    return scores


SCORE_KEYS = ("avg_at_k", "avg_at_k_masked", "gap_avg_at_k", "greedy", "greedy_masked", "gap_greedy")


def summarise(per_benchmark: dict[str, dict], groups: dict[str, str]) -> list[dict]:
    """Rows for a table: each benchmark, then each group's and the overall mean over benchmarks (the paper
    averages benchmark scores, not items)."""
    rows = [
        {"name": name, "group": groups[name], **{k: s[k] for k in SCORE_KEYS}} for name, s in per_benchmark.items()
    ]
    pools = {group: [r for r in rows if r["group"] == group] for group in GROUPS}
    pools["overall"] = list(rows)
    for name, members in pools.items():
        if members:
            rows.append({"name": name, "group": "summary", **{k: _mean_scored(members, k) for k in SCORE_KEYS}})
    return rows


def _mean_scored(rows: list[dict], key: str) -> float:
    """The mean over the benchmarks that had items (NaN when none had)."""
    scored = [r[key] for r in rows if math.isfinite(r[key])]
    return mean(scored) if scored else math.nan


def mlflow_metrics(table: list[dict]) -> dict[str, float]:
    """``eval/<name>/<score>`` for every row of :func:`summarise`, and the overall greedy score once more under the
    name every run's held-out accuracy has (``metric_keys.HELDOUT_ACCURACY``)."""
    metrics = {
        f"eval/{row['name']}/{key}": float(row[key]) for row in table for key in SCORE_KEYS if math.isfinite(row[key])
    }
    if "eval/overall/greedy" in metrics:
        metrics[HELDOUT_ACCURACY] = metrics["eval/overall/greedy"]
        # which mean the overall score is: over this many benchmarks (with items), not over items
        metrics["eval/overall/benchmarks"] = float(benchmark_count(table))
    return metrics


def benchmark_count(table: list[dict]) -> int:
    """The benchmarks of ``summarise``'s table that had items: what its group and overall rows average over."""
    return sum(row["group"] != "summary" and math.isfinite(row["greedy"]) for row in table)


# --------------------------------------------------------------------------------------------
# the notebook's body: policy, benchmarks, scores
# --------------------------------------------------------------------------------------------

SYNTHETIC_SUITE = {"shapes_one_figure": GENERAL, "shapes_two_figures": VISION_DEPENDENT}
# eval_dataset testbed:<name>: the perception testbed's two splits in the official schema, asking for \boxed{}
TESTBED_SUITE = {"testbed_text": GENERAL, "testbed_vision": VISION_DEPENDENT}


def synthetic_suite(n: int, seed: int) -> datasets.DatasetDict:
    """The local CPU test set in the official schema: one-figure and two-figure counting problems."""
    from papo_nb.testbed.official_schema import make_official_schema_dataset

    return datasets.DatasetDict(
        {
            "shapes_one_figure": make_official_schema_dataset(n, seed=seed, two_image_every=0),
            "shapes_two_figures": make_official_schema_dataset(n, seed=seed + 1, two_image_every=1),
        }
    )


def testbed_suite(n: int, seed: int) -> datasets.DatasetDict:
    """The perception testbed's task as two official-schema benchmarks: text-answerable (general) and
    vision-dependent items, each asking for the answer in ``\\boxed{}``, graded by the official reward."""
    from papo_nb.testbed.perception import make_official_perception_dataset

    return datasets.DatasetDict(
        {
            "testbed_text": make_official_perception_dataset(n, seed=seed, kind="text"),
            "testbed_vision": make_official_perception_dataset(n, seed=seed + 1, kind="vision"),
        }
    )


def local_suite(eval_dataset: str, n: int, seed: int) -> datasets.DatasetDict | None:
    """The benchmarks built here for ``eval_dataset`` ``synthetic`` or ``testbed:<name>``; None for any other
    source (a hub id or a folder, loaded by ``load_benchmark``)."""
    from papo_nb.testbed.perception import testbed_name

    if eval_dataset == "synthetic":
        return synthetic_suite(n, seed)
    if testbed_name(eval_dataset) is not None:
        return testbed_suite(n, seed)
    return None


def load_eval_policy(params, *, base: bool = False):
    """(model, processor, description): the base model, or ``eval_checkpoint`` (a LoRA adapter folder on the base, or
    a full model folder; ``checkpoint_source.WORKBOOK_CHECKPOINT``: the one notebook 03 saved), in eval mode, with the
    recipe's pixel bounds on the processor. ``base``: the base model whatever ``eval_checkpoint`` says."""
    from papo_nb.testbed.models import load_vlm
    from papo_nb.workbook.config.paths import resolve_device
    from papo_nb.workbook.recipe.data import set_processor_pixel_bounds
    from papo_nb.workbook.training.builder import load_policy

    checkpoint = None if base else resolve_eval_checkpoint(params)
    if checkpoint is not None and not checkpoint.is_dir():
        raise RecipeDataError(f"parameter 'eval_checkpoint' = {params.eval_checkpoint!r}: no such folder {checkpoint}")
    if checkpoint is not None and (checkpoint / "config.json").exists():
        model, processor = load_vlm(checkpoint)
        model, described = model.to(resolve_device(params)), f"full checkpoint {checkpoint}"
    else:
        model, processor = load_policy(params)
        described = f"base model {params.model_name_or_path}"
        if checkpoint is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
            described = f"LoRA adapter {checkpoint} merged into {params.model_name_or_path}"
    set_processor_pixel_bounds(processor, params.min_pixels, params.max_pixels)
    eval_review.use_evaluated_model(params, checkpoint, described)  # the evaluation's metrics attach to it
    return model.eval(), processor, described


def benchmark_rows(params, processor) -> dict[str, tuple[datasets.Dataset, str, dict]]:
    """{benchmark: (TRL-ready rows, group, filter report)} for ``eval_benchmarks`` of ``eval_dataset``
    (``synthetic``: the local test set; ``testbed:<name>``: the perception testbed's splits)."""
    from papo_nb.workbook.recipe.data import prepare_split

    groups = parse_benchmarks(params.eval_benchmarks)
    suite = local_suite(params.eval_dataset, params.n_eval_prompts, params.seed)
    out = {}
    for name, group in groups.items():
        if suite is not None and name not in suite:
            raise RecipeDataError(
                f"parameter 'eval_benchmarks' names {name!r}; eval_dataset {params.eval_dataset!r} has {sorted(suite)}"
            )
        raw = suite[name] if suite is not None else load_benchmark(params.eval_dataset, name)
        rows, report = prepare_split(
            raw, processor, format_prompt=params.format_prompt, min_pixels=params.min_pixels,
            max_pixels=params.max_pixels, max_prompt_length=params.max_prompt_length, limit=params.n_eval_prompts,
        )  # fmt: skip
        out[name] = (rows, group, report.to_dict())
    eval_review.log_benchmark_inputs(params, out)
    return out
