"""Every change that makes a run fit, as one plan: the memory levers first (they keep the recipe's batches), then
vLLM's share of the GPU, then the micro-batch halved with the accumulation and the round's steps doubled, which
keeps the completions per optimizer step, the prompts per round and the steps per round but is a batch change and
says so. Each change is forecast on top of the ones before it, so the plan's last forecast is the run's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from papo_nb.workbook.recipe.forecast import Forecast, forecast

OFFLOAD_CONFIG = "configs/accelerate/fsdp_offload.yaml"
LOWEST_VLLM_SHARE = 0.3  # TRL's default; below it the engine's KV cache holds too few of the round's rows


@dataclass
class Change:
    parameter: str
    old: object
    new: object
    why: str
    batch: bool = False  # changes the micro-batch (completions per step, prompts and steps per round kept)
    also: dict = field(default_factory=dict)  # the parameters that change with it

    def overrides(self) -> str:
        return " ".join(f"-p {k}={v}" for k, v in {self.parameter: self.new, **self.also}.items())

    def line(self, recipe: str, root: Path | None = None) -> str:
        """The change as printed, marked where it departs from ``recipe``'s file (under ``root``, else the cwd)."""
        departs = recipe and recipe_value(recipe, self.parameter, root) != self.new
        marks = [f"departs from recipe {recipe!r}"] if departs else []
        if self.batch:
            marks.append("BATCH CHANGE: micro-batch, completions per step and per round kept")
        return f"{self.parameter}: {self.old!r} -> {self.new!r}  ({self.why}){''.join(f' [{m}]' for m in marks)}"


def recipe_value(recipe: str, parameter: str, root: Path | None = None):
    """The value the named recipe's shipped file (``params/recipes/`` under ``root``, the project folder; None: the
    cwd) sets; None where it has no file or does not set it."""
    import yaml

    path = Path(root or ".") / "params" / "recipes" / f"{recipe}.yaml"
    return (yaml.safe_load(path.read_text()) or {}).get(parameter) if path.is_file() else None


def candidates(params, fc: Forecast, usable: float) -> list[Change]:
    """The next changes to try, in order, given the run as it stands."""
    s, out = fc.setting, []
    if s.use_vllm and s.vllm_mode == "colocate" and not s.vllm_sleep:
        out.append(Change("vllm_enable_sleep_mode", False, True, "vLLM's share released while training"))
    if s.beta > 0 and not s.lora and s.reference_bytes == 4:
        out.append(Change("reference_precision", "fp32", "bf16", "half the reference model"))
    if s.fsdp and not s.offload and not s.lora:
        out.append(Change("accelerate_config", params.accelerate_config, OFFLOAD_CONFIG,
                          "parameters, gradients and AdamW states on the CPU; costs PCIe time"))  # fmt: skip
    if s.use_vllm and s.vllm_mode == "colocate" and s.vllm_share > LOWEST_VLLM_SHARE and fc.peak_phase == "generate":
        # the largest share (in steps of 0.05) that fits beside the rest of the generation phase, TRL's 0.3 at least
        room = (usable - fc.total + fc.parts["generation"]) / fc.gpu_memory
        share = max(LOWEST_VLLM_SHARE, min(s.vllm_share - 0.05, math.floor(room / 0.05 + 1e-9) * 0.05))
        out.append(Change("vllm_gpu_memory_utilization", s.vllm_share, round(share, 2), "a smaller vLLM share"))
    if s.micro_batch % 2 == 0 and (s.micro_batch // 2) % params.num_generations == 0:
        also = {"gradient_accumulation_steps": params.gradient_accumulation_steps * 2}
        if params.steps_per_generation:
            also["steps_per_generation"] = params.steps_per_generation * 2
        out.append(Change("per_device_train_batch_size", s.micro_batch, s.micro_batch // 2,
                          "half the micro-batch, twice the accumulation", batch=True, also=also))  # fmt: skip
    return out


def apply(params, change: Change):
    return params.model_copy(update={change.parameter: change.new, **change.also})


def fit_plan(params, fc: Forecast, usable: float, limit: int = 8) -> tuple[list[Change], Forecast, object]:
    """(the changes, the forecast after them, the params after them): the first candidate that lowers the peak is
    taken each round, until the run fits in ``usable`` bytes or nothing helps; ``fc`` is the run's own forecast."""
    changes = []
    while fc.total > usable and len(changes) < limit:
        for change in candidates(params, fc, usable):
            trial = apply(params, change)
            trial_fc = forecast(trial, fc.gpu_memory, fc.widths, fc.root)
            if trial_fc.total < fc.total:
                changes.append(change)
                params, fc = trial, trial_fc
                break
        else:
            break
    return changes, fc, params
