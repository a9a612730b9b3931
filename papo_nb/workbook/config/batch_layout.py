"""The run's batch arithmetic in prompts and completions, beside the schema that validates it: what TRL would
refuse and where the batches differ from the official rollout rounds and optimizer steps."""

from __future__ import annotations

OFFICIAL_ROLLOUT_PROMPTS = 384  # *_grpo_papo.sh:15 ROLLOUT_BATCH_SIZE
OFFICIAL_UPDATE_PROMPTS = 128  # *_grpo_papo.sh:14 GLOBAL_BATCH_SIZE (actor.global_batch_size, in prompts)


def batch_layout(params) -> dict:
    """The run's batches in prompts and completions, and their official counterparts."""
    world = params.num_processes
    per_step = params.per_device_train_batch_size * world * params.gradient_accumulation_steps
    per_generation_steps = params.steps_per_generation or params.gradient_accumulation_steps
    generation = params.per_device_train_batch_size * world * per_generation_steps
    return {
        "completions_per_optimizer_step": per_step,
        "prompts_per_optimizer_step": per_step / params.num_generations,
        "completions_per_generation": generation,
        "prompts_per_generation": generation / params.num_generations,
        "optimizer_steps_per_generation": per_generation_steps / params.gradient_accumulation_steps,
    }


def check_batches(params, layout: dict) -> list[str]:
    """What TRL would refuse, or what would split optimizer steps across rollout rounds."""
    problems = []
    n = params.num_generations
    if params.steps_per_generation and params.steps_per_generation % params.gradient_accumulation_steps:
        problems.append(
            f"parameter 'steps_per_generation' = {params.steps_per_generation}: must be a multiple of "
            f"gradient_accumulation_steps = {params.gradient_accumulation_steps} (whole optimizer steps per rollout)"
        )
    if layout["completions_per_generation"] % n:
        problems.append(
            f"parameter 'steps_per_generation' = {params.steps_per_generation}: the rollout batch of "
            f"{layout['completions_per_generation']} completions is not a multiple of num_generations = {n}; "
            "change steps_per_generation or per_device_train_batch_size"
        )
    return problems


def batch_deviations(params, layout: dict) -> list[str]:
    """Where the batches differ from the official 384-prompt rounds and 128-prompt optimizer steps."""
    problems = []
    if params.recipe:
        for key, official in (
            ("prompts_per_generation", OFFICIAL_ROLLOUT_PROMPTS),
            ("prompts_per_optimizer_step", OFFICIAL_UPDATE_PROMPTS),
        ):
            if layout[key] != official:
                knob = "steps_per_generation" if key == "prompts_per_generation" else "gradient_accumulation_steps"
                problems.append(
                    f"recipe {params.recipe!r}: {key} = {layout[key]:g}, official {official}; with "
                    f"num_processes = {params.num_processes} and per_device_train_batch_size = "
                    f"{params.per_device_train_batch_size}, change {knob}"
                )
    return problems
