"""docs/recipe.md's forecast tables. First every GPU recipe on its authors' GPUs (80 GB), as shipped and as it was
before its memory levers (FSDP2 on the GPU, TRL's fp32 reference, vLLM awake at TRL's 0.3 share; vppo_7b at the
official micro-batch of 16); then ``params/gpu.yaml`` and every recipe at its own model on 1, 2, 4 and 8 GPUs of 80
and 141 GB, the recipes keeping their global batch (accumulation and the round's steps scaled by the authors' GPU
count over N). Regenerate from the repository root with ``python -m papo_nb.workbook.recipe.forecast_table --write``
(``--root`` names another checkout; without ``--write`` it prints them); tests/test_forecast_table.py fails when the
committed tables differ. Every path is relative to ``root``: the params files and an accelerate config they name."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from papo_nb.workbook.doc_blocks import block_command, replace_block
from papo_nb.workbook.recipe.architectures import published_config, widths
from papo_nb.workbook.recipe.forecast import GIB, forecast
from papo_nb.workbook.recipe.forecast_report import USABLE, step_seconds, verdict
from papo_nb.workbook.recipe.levers import levers_used
from papo_nb.workbook.recipe.plan import fit_plan

RECIPES = ("grpo_3b", "papo_g_3b", "grpo_7b", "papo_g_7b", "vppo_7b")
FILES = ("params/gpu.yaml", *(f"params/recipes/{n}.yaml" for n in RECIPES))
GPU_COUNTS = (1, 2, 4, 8)
GPUS = {"80 GB": 79.6 * GIB, "141 GB": 140.4 * GIB}  # what torch reports of an H100 80GB and an H200 (GiB)
# Each recipe as shipped before it used the memory levers (the table's levers column): params/recipes/*.yaml at 1f60324
BEFORE = {
    "accelerate_config": "configs/accelerate/fsdp.yaml",
    "reference_precision": "fp32",
    "vllm_enable_sleep_mode": False,
    "vllm_gpu_memory_utilization": 0.3,
}
BEFORE_BATCH = {"vppo_7b": {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 8,
                            "steps_per_generation": 24}}  # fmt: skip
BEGIN, END = "<!-- forecast table: begin -->", "<!-- forecast table: end -->"
DOC = Path("docs") / "recipe.md"  # relative to the root
HEADER = (
    "| file | GPUs | GPU | levers | fits | peak GiB | weights+grads+Adam | reference | activations | "
    "log-prob + masked logits | generation | round tensors | CPU GiB per node | step s | of it offload s | "
    "the plan that makes it fit |"
)


@cache
def model_widths(model: str):
    return widths(published_config(model))


def run_forecast(params, memory: float, root: Path):
    return forecast(params, memory, model_widths(params.model_name_or_path), root)


def plan_cell(params, fc) -> str:
    """The preflight's plan (``plan.fit_plan``) as overrides, or what still does not fit."""
    changes, planned, _ = fit_plan(params, fc, USABLE * fc.gpu_memory)
    text = " ".join(c.overrides() for c in changes)
    return text if verdict(planned)["fits"] else f"{text} (still {planned.total / GIB:.0f} GiB)".strip()


def load(file: str, root: Path):
    from papo_nb.workbook.config.params import load_params

    return load_params(Path(root) / file)


def row(label: str, gpu: str, params, root: Path) -> str:
    fc = run_forecast(params, GPUS[gpu], root)
    p, v, n = fc.parts, verdict(fc), params.num_processes
    states = p["weights"] + p["gradients"] + p["optimizer"]
    step = step_seconds(fc, fc.gpu_memory)
    change = "" if v["fits"] else plan_cell(params, fc)
    cells = [
        label, str(n), gpu, ", ".join(levers_used(fc.setting)) or "none", "yes" if v["fits"] else "**no**",
        f"{fc.total / GIB:.1f}", f"{states / GIB:.1f}", f"{p['reference'] / GIB:.1f}",
        f"{(p['activations'] + p['recompute']) / GIB:.1f}",
        f"{(p['logprob_forward'] + p['masked_forward']) / GIB:.1f}",
        f"{p['generation'] / GIB:.1f}", f"{p['round_tensors'] / GIB:.1f}", f"{fc.host / GIB:.0f}",
        f"{step['total_s']:.0f}", f"{step['offload_s']:.0f}", change,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def authors_rows(root: Path) -> list[str]:
    out = []
    for name in RECIPES:
        params = load(f"params/recipes/{name}.yaml", root)
        before = params.model_copy(update={**BEFORE, **BEFORE_BATCH.get(name, {})})
        for label, p in ((f"{name}.yaml before", before), (f"{name}.yaml", params)):
            out.append(row(label, "80 GB", p, root))
    return out


def scaled(params, n: int):
    """``params`` on ``n`` processes; a recipe keeps its global batch where the authors' count over ``n`` scales
    its accumulation and round evenly."""
    update = {"num_processes": n}
    authors = params.num_processes
    if params.recipe and (params.gradient_accumulation_steps * authors) % n == 0:
        update["gradient_accumulation_steps"] = params.gradient_accumulation_steps * authors // n
        if params.steps_per_generation:
            update["steps_per_generation"] = params.steps_per_generation * authors // n
    return params.model_copy(update=update)


def scale_rows(root: Path) -> list[str]:
    out = []
    for file in FILES:
        base = load(file, root)
        for n in GPU_COUNTS:
            for gpu in GPUS:
                out.append(row(Path(file).name, gpu, scaled(base, n), root))
    return out


def table(root: Path) -> str:
    """Both tables, from the params files under ``root``."""
    rule = "|" + "---|" * 16
    return "\n".join([
        "On the authors' GPUs (80 GB), as shipped and before the memory levers:", "", HEADER, rule,
        *authors_rows(root), "", "Every file at its own model on 1 to 8 GPUs (recipes at their global batch):", "",
        HEADER, rule, *scale_rows(root),
    ])  # fmt: skip


def document(text: str, root: Path) -> str:
    """``text`` (docs/recipe.md) with the tables between its markers replaced by today's, from ``root``'s files."""
    return replace_block(text, f"{table(root)}\n", (BEGIN, END))


def main(argv: list[str] | None = None) -> int:
    return block_command(argv, "docs/recipe.md's forecast tables", DOC, lambda root: root, document, table)


if __name__ == "__main__":
    raise SystemExit(main())
