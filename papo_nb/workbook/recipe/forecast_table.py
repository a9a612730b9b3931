"""docs/recipe.md's forecast table: ``params/gpu.yaml`` and every GPU recipe, each at Qwen2.5-VL-3B and -7B, on 1, 2,
4 and 8 GPUs of 80 and 141 GB. Regenerate with ``python -m papo_nb.workbook.recipe.forecast_table --write``
(``--table`` prints it); tests/test_forecast_table.py fails when the committed table differs."""

from __future__ import annotations

import sys
from pathlib import Path

from papo_nb.workbook.doc_blocks import replace_block
from papo_nb.workbook.recipe.architectures import published_config, widths
from papo_nb.workbook.recipe.forecast import GIB, forecast
from papo_nb.workbook.recipe.forecast_report import advice, largest_part, step_seconds, verdict

ROOT = Path(__file__).resolve().parents[3]
FILES = ("params/gpu.yaml", *(f"params/recipes/{n}.yaml" for n in ("grpo_3b", "papo_g_3b", "grpo_7b", "papo_g_7b",
                                                                   "vppo_7b")))  # fmt: skip
MODELS = ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct")
GPU_COUNTS = (1, 2, 4, 8)
GPUS = {"80 GB": 79.6 * GIB, "141 GB": 140.4 * GIB}  # what torch reports of an H100 80GB and an H200 (GiB)
BEGIN, END = "<!-- forecast table: begin -->", "<!-- forecast table: end -->"
DOC = ROOT / "docs" / "recipe.md"


def rows() -> list[str]:
    from papo_nb.workbook.config.params import load_params

    shapes = {model: widths(published_config(model)) for model in MODELS}
    out = []
    for file in FILES:
        base = load_params(ROOT / file)
        for model in MODELS:
            for n in GPU_COUNTS:
                params = base.model_copy(update={"model_name_or_path": model, "num_processes": n})
                for label, memory in GPUS.items():
                    out.append(row(file, model, n, label, forecast(params, memory, shapes[model])))
    return out


def row(file: str, model: str, n: int, label: str, fc) -> str:
    p, v = fc.parts, verdict(fc)
    states = p["weights"] + p["gradients"] + p["optimizer"]
    step = step_seconds(fc, fc.gpu_memory)["total_s"]
    change = "" if v["fits"] else f"{largest_part(fc)}: {advice(fc, largest_part(fc))}"
    cells = [
        Path(file).name, model.split("/")[-1].replace("-Instruct", ""), str(n), label,
        "yes" if v["fits"] else "**no**", f"{fc.total / GIB:.0f}", f"{states / GIB:.1f}",
        f"{p['reference'] / GIB:.1f}",
        f"{p['activations'] / GIB:.1f}", f"{(p['logprob_forward'] + p['masked_forward']) / GIB:.1f}",
        f"{p['generation'] / GIB:.0f}", f"{p['round_tensors'] / GIB:.1f}", f"{step:.0f}", change,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    header = (
        "| file | model | GPUs | GPU | fits | peak GiB | weights+grads+Adam | reference | activations | "
        "log-prob + masked logits | generation | round tensors | step s | what to change |"
    )
    return "\n".join([header, "|" + "---|" * 14, *rows()])


def document(text: str) -> str:
    """``text`` (docs/recipe.md) with the table between its markers replaced by today's."""
    return replace_block(text, f"{table()}\n", (BEGIN, END))


if __name__ == "__main__":
    if "--write" in sys.argv:
        DOC.write_text(document(DOC.read_text()))
    else:
        print(table())
