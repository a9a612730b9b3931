"""The workbook's parameter schema: one flat mapping shared by every notebook, validated before anything runs.

A params file (``params/*.yaml``) sets any of these fields; ``-p key=value`` overrides them. Each notebook
declares the subset it uses in its ``parameters`` cell, and the runner passes it exactly that subset.

The PAPO-G fields are not typed here: they are derived from the ``PAPOGConfig`` dataclass (type, default, help,
choices and rule), so a field added to the config is a parameter at once and the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_type_hints

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from papo_nb.papo.papo_config import FIELD_RULES, PAPOGConfig, papo_fields
from papo_nb.prefix_sharing.config import field_problem
from papo_nb.vppo.vppo_config import VPPO_FIELD_RULES, VPPO_FIXED, VPPOConfig
from papo_nb.workbook.config.param_errors import DEFAULT_ORIGIN, describe_error, plain_message
from papo_nb.workbook.config.study_params import StudyParams
from papo_nb.workbook.config.vllm_params import VLLMParams


class ParamsError(ValueError):
    """A params file or override is invalid; the message names the key, the value and what is allowed."""


# PAPOGConfig fields the workbook sets from another parameter instead of exposing them: name -> why.
DERIVED_PAPO_FIELDS = {"mask_seed": "set from 'seed' (the trainer adds the process index)"}
# Where the workbook's default differs from PAPOGConfig's: the workbook runs the probe unless told otherwise.
WORKBOOK_PAPO_DEFAULTS = {"require_gpu_contract_probe": True}


def _papo_param_fields() -> dict[str, tuple]:
    """``name -> (annotation, Field)`` for every PAPOGConfig field a run sets, read off the dataclass."""
    hints = get_type_hints(PAPOGConfig)
    derived = {}
    for f in papo_fields():
        if f.name in DERIVED_PAPO_FIELDS:
            continue
        choices = f.metadata.get("choices")
        annotation = Literal[choices] if choices else hints[f.name]
        derived[f.name] = (
            annotation,
            Field(WORKBOOK_PAPO_DEFAULTS.get(f.name, f.default), description=f.metadata["help"]),
        )
    return derived


PAPO_PARAM_FIELDS = _papo_param_fields()
# VPPOConfig's own fields (the token fraction, the advantage band), derived the same way; set only with method 'vppo'.
VPPO_PARAM_FIELDS = {
    f.name: (get_type_hints(VPPOConfig)[f.name], Field(f.default, description=f.metadata["help"]))
    for f in fields(VPPOConfig)
    if f.name in VPPO_FIELD_RULES
}


class _StrictParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


def _config_rule(rules: dict):
    """A field validator applying the config's own rule for the field from ``rules`` (papo_config.FIELD_RULES or
    vppo_config.VPPO_FIELD_RULES), so the params model and the config refuse the same values."""

    def check(cls, value, info):
        problem = field_problem(rules, info.field_name, value)
        if problem:
            raise ValueError(problem)
        return value

    return check


def _vppo_fixed(self):
    """With method 'vppo', the PAPO-G fields VPPO cannot take another value of (before any model loads)."""
    if self.method == "vppo":
        for name, (value, why) in VPPO_FIXED.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"parameter {name!r} = {getattr(self, name)!r} with method 'vppo': {why}; allowed: {value!r}"
                )
    return self


PAPOParams = create_model(
    "PAPOParams",
    __base__=_StrictParams,
    __doc__="The PAPO-G parameters, derived from PAPOGConfig, and VPPO's, derived from VPPOConfig.",
    __validators__={
        "papo_rule": field_validator(*PAPO_PARAM_FIELDS)(_config_rule(FIELD_RULES)),
        "vppo_rule": field_validator(*VPPO_PARAM_FIELDS)(_config_rule(VPPO_FIELD_RULES)),
        "vppo_fixed": model_validator(mode="after")(_vppo_fixed),
    },
    method=(
        Literal["papo_g", "vppo"],
        Field(
            "papo_g",
            description="the masked-branch method: 'papo_g' (PAPOGTrainer; gamma 0 is GRPO) or 'vppo' (VPPOTrainer, "
            "arXiv 2510.09285)",
        ),
    ),
    **PAPO_PARAM_FIELDS,
    **VPPO_PARAM_FIELDS,
)


class WorkbookParams(PAPOParams, VLLMParams, StudyParams):
    """Every workbook parameter, documented; defaults are the CPU smoke run on the tiny offline model. The vLLM
    rollout fields come from ``VLLMParams`` (config.vllm_params), notebook 04's from ``StudyParams``
    (config.study_params)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
    _origins: dict[str, str] = PrivateAttr(default_factory=dict)  # where each value was set (validate_params)

    # --- model, data, hardware ---
    model_name_or_path: str = Field(
        "tiny:qwen2_vl", description="hub id, local folder, or tiny:<family> to build the offline tiny model"
    )
    dataset: str = Field(
        "synthetic",
        description="'synthetic' (shapes task), testbed:<name>, or a hub id / local folder of your own rows "
        "(prompt, image or images, answer: docs/data.md)",
    )
    train_split: str = Field("train", min_length=1, description="own rows: the split trained on")
    eval_split: str = Field("test", min_length=1, description="own rows: the held-out split (final evaluation)")
    reward: list[str] = Field(
        default_factory=list,
        description="reward functions: shipped names ('shapes', 'shapes_accuracy', 'math', 'boxed_accuracy') or "
        "your own 'module:function' with TRL's signature (docs/data.md); empty: the schema's ('shapes' or 'math')",
    )
    reward_weights: list[float] = Field(
        default_factory=list,
        description="TRL's reward_weights: one per reward function (a name may stand for several: 'math' for two); "
        "empty: each name's own weights ('math': 0.9, 0.1), 1 for your own",
    )
    seed: int = Field(0, ge=0, description="seed for data, model building, masks and training")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where to run; auto picks cuda when present")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="training precision (bf16 mixed precision on GPU)")
    n_train_prompts: int = Field(32, ge=1, le=1_000_000, description="synthetic training prompts")
    n_eval_prompts: int = Field(
        24, ge=1, le=100_000, description="held-out synthetic prompts for the final evaluation"
    )

    # --- 01 contract verification ---
    trl_releases: list[str] = Field(
        default_factory=list,
        description="TRL releases for the drift table; empty: 0.29.1 and 1.9.1 to the newest on the index",
    )
    upstream_wheel: str = Field("", description="path to a trl-0.29.1 wheel; empty fetches it with pip")

    # --- 02 probe calibration ---
    calibration_batches: int = Field(3, ge=1, le=100, description="probe batches per phase and precision")
    calibration_precisions: list[Literal["fp32", "bf16"]] = Field(
        default_factory=lambda: ["fp32", "bf16"], description="precisions compared"
    )
    phase2_train_steps: int = Field(4, ge=1, le=10_000, description="training steps that make the phase-2 policy")
    phase2_checkpoint: str = Field(
        "", description="adapter checkpoint to resume into for phase 2; empty trains one here"
    )
    injected_leak_scale: float = Field(1.0, gt=0, description="scale of the deliberately injected perception leak")

    # --- 03 training run (PAPO-G) ---
    max_steps: int = Field(6, ge=1, le=1_000_000, description="optimizer steps")
    learning_rate: float = Field(
        5e-4, gt=0, le=1.0, description="AdamW learning rate (LoRA scale; paper full-FT lr is 1e-6)"
    )
    per_device_train_batch_size: int = Field(4, ge=1, le=4096, description="completions per device per step")
    num_generations: int = Field(4, ge=2, le=64, description="rollouts per prompt (paper: 5)")
    max_completion_length: int = Field(16, ge=1, le=32768, description="generated tokens per completion")
    temperature: float = Field(1.0, gt=0, le=10.0, description="sampling temperature (paper: 1.0)")
    # loss_type, beta and the PAPO-G fields come from PAPOParams (derived from PAPOGConfig).
    lora_r: int = Field(8, ge=1, le=1024, description="LoRA rank")
    lora_alpha: int = Field(16, ge=1, le=4096, description="LoRA alpha")
    save_steps: int = Field(3, ge=1, le=1_000_000, description="checkpoint every this many steps")
    save_total_limit: int | None = Field(
        3,
        ge=1,
        le=100_000,
        description="checkpoints kept in the run folder, the oldest deleted first (transformers' save_total_limit; "
        "the last one always stays, so resume finds it); None: keep every checkpoint",
    )
    init_adapter: str = Field(
        "", description="phase 2: start from this trained adapter checkpoint; empty starts a fresh adapter"
    )
    reference_policy: Literal["init_adapter", "base"] = Field(
        "init_adapter",
        description="KL reference (beta > 0) with init_adapter set: a frozen copy of that adapter (TRL's "
        "default) or the base model with adapters disabled; without init_adapter both are the base model",
    )

    # --- scale-out (papo-nb train) ---
    num_processes: int = Field(
        1,
        ge=1,
        le=1024,
        description="training processes, one per GPU; > 1 runs papo-nb train under "
        "accelerate launch (DDP unless accelerate_config says otherwise)",
    )
    accelerate_config: str = Field(
        "",
        description="accelerate config file for num_processes > 1 (see configs/accelerate/); "
        "empty: multi_gpu.yaml (DDP) on GPU, cpu_gloo.yaml on the CPU",
    )

    # --- the official recipe (params/recipes/*.yaml; papo_nb.workbook.recipe.data, recipe_presets) ---
    recipe: str = Field(
        "",
        description="official recipe whose preset supplies the PAPOGConfig fields not exposed here (papo_g_3b, "
        "papo_g_7b, papo_g_no_kl_ref, grpo_3b, grpo_7b, vppo_7b); empty: none",
    )
    dataset_schema: Literal["shapes", "official"] = Field(
        "shapes",
        description="'shapes': prompt/image/answer rows and the shapes reward; 'official': PAPO's problem/answer/"
        "images rows, format prompt, pixel bounds, over-long filter and math reward (0.9 boxed accuracy + 0.1 format)",
    )
    validation_dataset: str = Field(
        "", description="official schema: held-out set (hub id, id@split or local folder); empty only with 'synthetic'"
    )
    format_prompt: str = Field(
        "math_perception", description="official schema: 'math_perception', 'none' or a jinja file with {{ content }}"
    )
    min_pixels: int = Field(
        3136, ge=784, description="own/official rows: fewest pixels per image (official: 200704, 256 28x28 patches)"
    )
    max_pixels: int = Field(
        12544, ge=784, description="own/official rows: most pixels per image (official: 1003520, 1280 28x28 patches)"
    )
    max_prompt_length: int = Field(
        1024,
        ge=1,
        le=262144,
        description="own and official rows: longer prompts (image tokens included) are dropped (official: 4096)",
    )
    finetuning: Literal["lora", "full"] = Field(
        "lora", description="'lora' (adapters on q_proj/v_proj) or 'full' (every weight, as the official recipe)"
    )
    freeze_vision_tower: bool = Field(
        False, description="full fine-tuning: keep the vision tower frozen (official: no)"
    )
    reference_precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="full fine-tuning with beta > 0: dtype of TRL's frozen reference model ('fp32': TRL's default "
        "when model_init_kwargs is unset; 'bf16': half its memory, as the official ref worker); LoRA and beta 0 "
        "have no reference model",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, le=100_000, description="micro-batches per optimizer step")
    gradient_checkpointing: bool = Field(
        True,
        description="recompute each decoder layer's activations in the backward instead of keeping them (TRL's "
        "default, LoRA and full fine-tuning alike; Qwen2.5-VL-3B widths: 4 instead of 106 KiB saved per token and "
        "layer, TRL: about 20% slower)",
    )
    steps_per_generation: int = Field(
        0, ge=0, le=1_000_000, description="micro-batches per rollout batch; 0: gradient_accumulation_steps (TRL's)"
    )
    eval_dataset: str = Field(
        "synthetic",
        description="05 evaluation: benchmark source (PAPO-Galaxy/PAPO_eval, a local save_to_disk DatasetDict, or "
        "'synthetic': the local official-schema test set)",
    )
    eval_benchmarks: list[str] = Field(
        default_factory=lambda: ["shapes_one_figure:general", "shapes_two_figures:vision_dependent"],
        description="05 evaluation: benchmark splits as 'split' (an official one) or 'split:group' "
        "(group general or vision_dependent)",
    )
    eval_samples: int = Field(4, ge=1, le=64, description="05 evaluation: k of avg@k at temperature 1.0 (official: 8)")
    eval_checkpoint: str = Field(
        "",
        description="05 evaluation: a trained checkpoint (LoRA adapter or full model folder), "
        "'workbook:03_training_run' (the last checkpoint notebook 03 saved in this workbook run), or empty: base "
        "model",
    )
    eval_base_beside: bool = Field(
        False, description="05 evaluation: with a checkpoint, also score the base model, on the same items and masks"
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _one_reward_or_several(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("reward")
    @classmethod
    def _reward_spelling(cls, value: list[str]) -> list[str]:
        from papo_nb.workbook.config.reward_names import reward_spec_problem

        for spec in value:
            if (problem := reward_spec_problem(spec)) is not None:
                raise ValueError(f"entry {spec!r}: {problem}")
        return value

    @model_validator(mode="after")
    def _one_weight_per_reward_function(self):
        from papo_nb.workbook.config.reward_names import function_count, reward_specs

        expected = function_count(self.reward, self.dataset_schema)
        if self.reward_weights and len(self.reward_weights) != expected:
            raise ValueError(
                f"parameter 'reward_weights' = {self.reward_weights!r}: one weight per reward function, {expected} "
                f"for reward {reward_specs(self.reward, self.dataset_schema)!r}; empty: each name's own weights"
            )
        return self

    @model_validator(mode="after")
    def _study_params_valid(self):
        study_params_applied(self)
        return self

    @field_validator("eval_checkpoint")
    @classmethod
    def _known_workbook_checkpoint(cls, value: str) -> str:
        if value.startswith("workbook:") and value != "workbook:03_training_run":
            raise ValueError("a 'workbook:' checkpoint must be 'workbook:03_training_run'; or a folder, or empty")
        return value

    @field_validator("recipe")
    @classmethod
    def _known_recipe(cls, value: str) -> str:
        from papo_nb.workbook.recipe.presets import RECIPE_NAMES

        if value not in RECIPE_NAMES:
            raise ValueError(f"unknown recipe; allowed: {', '.join(repr(n) for n in RECIPE_NAMES)}")
        return value

    @classmethod
    def field_names(cls) -> set[str]:
        return set(cls.model_fields)

    def origin(self, name: str) -> str:
        """Where parameter ``name`` was set: a params file, ``-p name=value``, or the default."""
        return self._origins.get(name, DEFAULT_ORIGIN)


def study_params_applied(params: WorkbookParams) -> WorkbookParams:
    """``params`` with its ``study_params`` in place of the workbook's values (notebook 04 runs on these), validated
    as one set; ValueError names a key that is not a parameter or a value that is invalid."""
    if not params.study_params:
        return params
    unknown = sorted(set(params.study_params) - (WorkbookParams.field_names() - {"study_params"}))
    if unknown:
        raise ValueError(
            f"parameter 'study_params' = {params.study_params!r}: {', '.join(map(repr, unknown))} is not a workbook "
            "parameter it can set (any WorkbookParams field but study_params)"
        )
    values = params.model_dump(exclude={"study_params"}) | params.study_params
    try:
        return WorkbookParams.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {plain_message(e['msg'])}" for e in exc.errors())
        raise ValueError(f"parameter 'study_params' = {params.study_params!r} is invalid: {problems}") from None


def validate_params(
    values: dict[str, Any], source: str = "params", origins: dict[str, str] | None = None
) -> WorkbookParams:
    """Validate a mapping; raise ParamsError listing every bad key with its value, what is allowed and where the
    value came from: ``origins[key]`` (a params file, ``-p key=value``), else ``source`` when ``origins`` is None,
    else the default."""
    if not isinstance(values, dict):
        raise ParamsError(f"{source}: expected a mapping of parameter names to values, got {type(values).__name__}")

    def origin_of(key: str) -> str:
        return source if origins is None else origins.get(key, DEFAULT_ORIGIN)

    try:
        params = WorkbookParams.model_validate(values)
    except ValidationError as exc:
        lines = [describe_error(error, origin_of, WorkbookParams.model_fields) for error in exc.errors()]
        raise ParamsError("\n".join(lines)) from None
    params._origins = {key: origin_of(key) for key in values}
    return params


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as YAML (so numbers, booleans and lists keep their types)."""
    if "=" not in text:
        raise ParamsError(f"override {text!r} is not of the form key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load_params(path: str | Path | None, overrides: list[str] | None = None) -> WorkbookParams:
    """Read a YAML params file (None: all defaults), apply ``key=value`` overrides, validate."""
    values: dict[str, Any] = {}
    source = DEFAULT_ORIGIN
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ParamsError(f"params file {str(path)!r} does not exist")
        source = str(path)
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ParamsError(f"{source}: not valid YAML: {exc}") from None
        if not isinstance(values, dict):
            raise ParamsError(
                f"{source}: expected a mapping of parameter names to values, got {type(values).__name__}"
            )
    origins = dict.fromkeys(values, source)
    for item in overrides or []:
        key, value = parse_override(item)
        values[key], origins[key] = value, f"-p {item}"
    return validate_params(values, source, origins)


def notebook_params(namespace: dict[str, Any]) -> WorkbookParams:
    """The params a notebook's ``parameters`` cell defined (its globals), validated; other fields default."""
    return validate_params(
        {k: namespace[k] for k in WorkbookParams.model_fields if k in namespace}, "notebook parameters"
    )
