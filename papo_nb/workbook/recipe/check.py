"""The one preflight (``papo-nb preflight``; ``papo-nb train`` and ``papo-nb run`` apply its parameter checks before
anything loads): the memory and time forecast, once; the plan of every change that makes the run fit
(``plan.fit_plan``); the batch sizes TRL would refuse; the data's columns and rows and the image tokens against the
prompt limit; the GPUs here. Offline it never waits on the hub: with ``HF_HUB_OFFLINE`` set only the local cache is
read, otherwise the hub gets ``HUB_WAIT_S`` seconds to answer, and a dataset it cannot read is named in a note."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from papo_nb.workbook.config.batch_layout import batch_deviations, batch_layout, check_batches
from papo_nb.workbook.recipe import plan as fit
from papo_nb.workbook.recipe.data import OFFICIAL_COLUMNS, PATCH_PIXELS, RecipeDataError, load_rows
from papo_nb.workbook.recipe.forecast import Forecast, forecast
from papo_nb.workbook.recipe.forecast_report import USABLE, gpu_memory_here, refusal_text, verdict
from papo_nb.workbook.recipe.presets import recipe_deviations

HUB_HOST, HUB_WAIT_S = "huggingface.co", 5.0
OWN_COLUMNS = ("prompt", "answer")


@dataclass
class Preflight:
    forecast: Forecast
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)
    plan: list = field(default_factory=list)  # plan.Change, in order
    planned: Forecast | None = None  # the forecast after the plan
    estimates: dict = field(default_factory=dict)  # from the rows read: optimizer steps per epoch, epochs covered

    @property
    def fits(self) -> bool | None:
        return verdict(self.forecast)["fits"]


def batch_problems(params) -> list[str]:
    """What TRL would refuse: a micro-batch of split prompt groups, rounds of split groups or of split steps."""
    problems = []
    if params.per_device_train_batch_size % params.num_generations:
        problems.append(
            f"parameter 'per_device_train_batch_size' = {params.per_device_train_batch_size}: must be a multiple "
            f"of num_generations = {params.num_generations}"
        )
    return problems + check_batches(params, batch_layout(params))


def hub_reachable() -> bool:
    try:
        socket.create_connection((HUB_HOST, 443), timeout=HUB_WAIT_S).close()
    except OSError:
        return False
    return True


def read_dataset(params):
    """(the training rows or None, a note when they were not read); never waits on the hub past ``HUB_WAIT_S``."""
    name = params.dataset
    local = os.path.exists(os.path.expanduser(name.partition("@")[0]))
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not local and not offline and not hub_reachable():
        return None, (
            f"parameter 'dataset' = {name!r}: not checked, the hub did not answer within {HUB_WAIT_S:g} s "
            "(set HF_HUB_OFFLINE=1 to read the local cache, or give a local folder)"
        )
    try:
        return load_rows(name, getattr(params, "train_split", "train")), None
    except (RecipeDataError, OSError, ValueError, ConnectionError) as exc:
        return None, f"parameter 'dataset' = {name!r}: not checked, not readable here ({type(exc).__name__}: {exc})"


def data_problems(params, rows) -> list[str]:
    """The columns the run needs, at least one rollout round of rows, and images whose tokens fit the prompt."""
    columns = OFFICIAL_COLUMNS if params.dataset_schema == "official" else OWN_COLUMNS
    missing = [c for c in columns if c not in rows.column_names]
    problems = []
    if missing:
        problems.append(f"parameter 'dataset' = {params.dataset!r}: missing column(s) {missing}; needed "
                        f"{list(columns)}, it has {rows.column_names}")  # fmt: skip
    round_prompts = batch_layout(params)["prompts_per_generation"]
    if min(len(rows), params.n_train_prompts) < round_prompts:
        problems.append(f"parameter 'dataset' = {params.dataset!r}: {len(rows)} rows, fewer than one rollout round "
                        f"of {round_prompts:g} prompts; use more rows or lower steps_per_generation")  # fmt: skip
    image_column = next((c for c in ("images", "image") if c in rows.column_names), None)
    if image_column == "images" and len(rows):
        most = max(len(r or []) for r in rows.select(range(min(len(rows), 256)))[image_column])
        if most * params.max_pixels // PATCH_PIXELS >= params.max_prompt_length:
            problems.append(f"parameter 'max_pixels' = {params.max_pixels}: {most} image(s) of that size take "
                            f"{most * params.max_pixels // PATCH_PIXELS} tokens, not below max_prompt_length = "
                            f"{params.max_prompt_length}; lower max_pixels or raise max_prompt_length")  # fmt: skip
    return problems


def run_length(params, rows) -> dict:
    """Optimizer steps per epoch of the rows read (whole rounds only: TRL's RepeatSampler and the official loader
    drop the last, trl/trainer/utils.py:775-779, verl/trainer/data_loader.py:66) and the epochs ``max_steps`` covers;
    prompts the over-long filter drops are not counted here."""
    layout = batch_layout(params)
    rows_used = min(len(rows), params.n_train_prompts)
    steps = int(rows_used // layout["prompts_per_generation"] * layout["optimizer_steps_per_generation"])
    return {
        "rows": rows_used,
        "optimizer_steps_per_epoch": steps,
        "epochs_at_max_steps": params.max_steps / steps if steps else None,
        "completion_tokens_at_most": params.max_steps * layout["completions_per_optimizer_step"]
        * params.max_completion_length,
    }  # fmt: skip


def gpu_problems(params, here: int | None = None) -> list[str]:
    """More processes than the ``here`` GPUs (None: torch's count; none at all: nothing to compare, the memory
    verdict is then on ``--gpu-memory``)."""
    if here is None:
        import torch

        here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if params.device == "cuda" and here and here < params.num_processes:
        return [
            f"parameter 'num_processes' = {params.num_processes}: {here} GPU(s) here; set num_processes <= {here} "
            "(and raise gradient_accumulation_steps and steps_per_generation to keep the batches)"
        ]
    return []


def preflight(params, gpu_memory: float | None, read_data: bool = True, root: Path | None = None) -> Preflight:
    """Every check, the forecast once, and the plan when the run does not fit; ``root``: the project folder a
    relative ``accelerate_config`` is looked up in after the cwd."""
    result = Preflight(forecast(params, gpu_memory, root=root))
    result.problems += batch_problems(params) + gpu_problems(params)
    result.deviations += batch_deviations(params, batch_layout(params))
    result.deviations += [f"parameter {k!r} = {mine!r}, recipe {params.recipe!r}: {theirs!r}"
                          for k, (mine, theirs) in recipe_deviations(params).items()]  # fmt: skip
    if read_data and params.dataset != "synthetic" and not params.dataset.startswith("testbed:"):
        rows, note = read_dataset(params)
        result.notes += [note] if note else []
        result.problems += data_problems(params, rows) if rows is not None else []
        result.estimates = run_length(params, rows) if rows is not None else {}
    if result.fits is False:
        result.plan, result.planned, _ = fit.fit_plan(params, result.forecast, USABLE * gpu_memory)
    return result


def plan_lines(result: Preflight, recipe: str) -> list[str]:
    """The plan as printed: every change, marked, and the peak after them."""
    if not result.plan:
        return ["no change of the plan's levers or micro-batch makes it fit: see the largest part above"]
    fits = verdict(result.planned)["fits"]
    lines = [f"plan: {len(result.plan)} change(s) {'make it fit' if fits else 'are not enough'}, peak "
             f"{result.planned.total / 2**30:.1f} GiB:"]  # fmt: skip
    return lines + [f"  {c.overrides()}    # {c.line(recipe, result.forecast.root)}" for c in result.plan]


def parameter_problems(params, root: Path | None = None) -> list[str]:
    """What ``papo-nb train`` and ``papo-nb run`` refuse before anything loads: the batches TRL would refuse and, on
    ``device: cuda`` with a known GPU memory, a run that cannot fit, with the whole plan (no data read here: the
    run loads its data next and checks it there); ``root`` as ``preflight``'s."""
    memory = gpu_memory_here() if params.device == "cuda" else None
    if memory is None:  # a CPU run, or no GPU memory known: nothing to forecast against
        return batch_problems(params)
    try:
        result = preflight(params, memory, read_data=False, root=root)
    except ValueError as exc:  # no configuration to forecast from: say so, do not refuse
        print(f"papo-nb: note: memory not forecast: {exc}", file=sys.stderr)
        return batch_problems(params)
    problems = list(result.problems)
    if result.fits is False:
        plan = "\n  ".join(plan_lines(result, params.recipe))
        problems.append(f"the run does not fit in GPU memory (papo-nb preflight; before any weight loads): "
                        f"{refusal_text(result.forecast)}\n  {plan}")  # fmt: skip
    return problems
