"""From validated workbook parameters to the real objects: device, model, processor, datasets, PAPO-G trainer.

``prepare_training`` composes them into a trainer ready to ``train()`` or to probe: notebooks 01, 02 and the study
use it alone; ``papo_nb.train.runner.run_training`` (notebook 03 and ``papo-nb train``) wraps it in a run folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from papo_nb.papo import PAPOGConfig, PAPOGTrainer
from papo_nb.testbed.models import load_vlm, vision_special_token_ids
from papo_nb.testbed.perception import task_datasets, testbed_name
from papo_nb.testbed.shapes import make_shapes_dataset
from papo_nb.vppo import VPPOConfig, VPPOTrainer
from papo_nb.workbook.config.params import PAPO_PARAM_FIELDS, VPPO_PARAM_FIELDS, WorkbookParams
from papo_nb.workbook.config.paths import process_device, resolve_device, resolve_model_path
from papo_nb.workbook.config.vllm_params import vllm_config_fields
from papo_nb.workbook.recipe import presets as recipe_presets
from papo_nb.workbook.recipe import reward as math_reward
from papo_nb.workbook.recipe.data import official_datasets, set_processor_pixel_bounds
from papo_nb.workbook.recipe.own_data import own_datasets
from papo_nb.workbook.training.checkpoints import load_trainable_adapter
from papo_nb.workbook.training.model_card import ModelCardCallback
from papo_nb.workbook.training.review import attach_review
from papo_nb.workbook.training.rewards import (
    check_rewards_on_groups,
    guarded_reward_functions,
    reward_weights,
    weighted_rewards,
)

EVAL_SEED_OFFSET = 10_000  # held-out synthetic items come from a different stream than training items


def load_policy(params: WorkbookParams, cache_dir: str | Path | None = None):
    """The base VLM and its processor, in the training dtype, on this process's device (``process_device``)."""
    device = resolve_device(params)
    dtype = "bfloat16" if params.precision == "bf16" and device == "cuda" else "float32"
    placement = process_device(device, os.environ, torch.cuda.device_count() if device == "cuda" else 0)
    if placement.startswith("cuda:"):
        torch.cuda.set_device(placement)  # before any CUDA work of this process lands on GPU 0
    model, processor = load_vlm(resolve_model_path(params, cache_dir), dtype=dtype)
    if pixel_bounds_apply(params):  # the trainer's processor keeps images within the same bounds as the rows
        set_processor_pixel_bounds(processor, params.min_pixels, params.max_pixels)
    return model.to(placement), processor


def load_tokenizer(params: WorkbookParams):
    """The policy's tokenizer alone (no weights): what the reward check tokenizes its completion with."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(params))


def generated_dataset(params: WorkbookParams) -> bool:
    """The shapes schema's built-in generators (``synthetic``, ``testbed:<name>``), drawn at their own sizes."""
    return params.dataset_schema == "shapes" and (params.dataset == "synthetic" or testbed_name(params.dataset))


def pixel_bounds_apply(params: WorkbookParams) -> bool:
    """``min_pixels``/``max_pixels`` bound every loaded dataset, own rows and official alike; the generators'
    images are left as drawn, so runs on them are unchanged."""
    return not generated_dataset(params)


def load_datasets(params: WorkbookParams):
    """(train, held-out eval) datasets: the synthetic shapes task, a testbed's task (``testbed:<name>``), or one's
    own rows (``recipe.own_data``: ``train_split``/``eval_split`` of a hub id or folder, checked, bounded and
    filtered); ``dataset_schema='official'``: PAPO's data (``recipe_data``)."""
    if params.dataset_schema == "official":
        return official_datasets(params, resolve_model_path(params))
    if (name := testbed_name(params.dataset)) is not None:
        return task_datasets(
            name,
            params.n_train_prompts,
            params.n_eval_prompts,
            seed=params.seed,
            eval_seed=params.seed + EVAL_SEED_OFFSET,
        )
    if params.dataset == "synthetic":
        return (
            make_shapes_dataset(params.n_train_prompts, seed=params.seed),
            make_shapes_dataset(params.n_eval_prompts, seed=params.seed + EVAL_SEED_OFFSET),
        )
    return own_datasets(params, resolve_model_path(params))


def generation_kwargs(params: WorkbookParams, processor) -> dict:
    """The image-token suppression, spelled for the engine that generates: HF ``generate``'s ``suppress_tokens``;
    with vLLM a field its ``SamplingParams`` has, ``logit_bias`` of -inf per token id in colocate mode (exact ids,
    as suppress_tokens), ``bad_words`` (the tokens' strings) in server mode, whose request is JSON."""
    token_ids = vision_special_token_ids(processor)
    if not params.use_vllm:
        return {"suppress_tokens": token_ids}
    if params.vllm_mode == "colocate":
        return {"logit_bias": {token_id: float("-inf") for token_id in token_ids}}
    tokenizer = getattr(processor, "tokenizer", processor)
    return {"bad_words": tokenizer.convert_ids_to_tokens(token_ids)}


CHECKPOINTING_FIELD = next(
    name for name in ("activation_checkpointing", "gradient_checkpointing") if hasattr(PAPOGConfig, name)
)


def papo_config(
    params: WorkbookParams, output_dir: str | Path, processor, *, report_to: str = "none", **overrides
) -> PAPOGConfig:
    """A PAPOGConfig (a VPPOConfig with ``method='vppo'``) carrying every training parameter of the workbook; the
    PAPO-G and VPPO fields pass through by name (derived from the configs), so none is lost on the way."""
    on_gpu = resolve_device(params) == "cuda"
    settings = dict(
        output_dir=str(output_dir),
        seed=params.seed,
        max_steps=params.max_steps,
        learning_rate=params.learning_rate,
        per_device_train_batch_size=params.per_device_train_batch_size,
        num_generations=params.num_generations,
        max_completion_length=params.max_completion_length,
        temperature=params.temperature,
        **{name: getattr(params, name) for name in PAPO_PARAM_FIELDS},
        mask_seed=params.seed,
        bf16=params.precision == "bf16" and on_gpu,
        use_cpu=not on_gpu,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=params.save_steps,
        save_total_limit=params.save_total_limit,
        report_to=report_to,
        dataloader_num_workers=0,
        generation_kwargs=generation_kwargs(params, processor),
        **vllm_config_fields(params),
    )
    # A named recipe supplies the preset fields the params do not expose (clip range, weight decay, top_p...).
    settings.update(recipe_presets.config_fields(params))
    settings.update(
        gradient_accumulation_steps=params.gradient_accumulation_steps,
        steps_per_generation=params.steps_per_generation or None,
        # TRL's default (GRPOConfig.gradient_checkpointing True) and the official actor's (config_grpo_papo.yaml:65),
        # LoRA too; transformers 5.2x names the field activation_checkpointing, gradient_checkpointing its alias;
        # 5.17 (the vLLM venv's, scripts/vllm_cpu_env.sh) has only gradient_checkpointing.
        **{CHECKPOINTING_FIELD: params.gradient_checkpointing},
    )
    if params.reference_precision == "bf16":
        # TRL builds the reference model from model_init_kwargs (grpo_trainer.py:964-971), fp32 without a dtype; the
        # policy arrives loaded, so TRL warns that these kwargs are ignored for it, which they are.
        settings["model_init_kwargs"] = {"dtype": "bfloat16"}
    if (weights := reward_weights(params)) is not None:  # the researcher's rewards and weights, over any recipe's
        settings["reward_weights"] = weights
    elif params.dataset_schema == "official":
        # 0.9 accuracy + 0.1 format (math.py:43), unless the recipe weighs them (VPPO: accuracy alone)
        settings.setdefault("reward_weights", list(math_reward.REWARD_WEIGHTS))
    if params.method == "vppo":  # VPPOConfig: PAPOGConfig plus the token fraction and the advantage band
        settings.update({name: getattr(params, name) for name in VPPO_PARAM_FIELDS})
    settings.update(overrides)
    return (VPPOConfig if params.method == "vppo" else PAPOGConfig)(**settings)


LORA_TARGETS = ("q_proj", "v_proj")


def lora_config(params: WorkbookParams, model=None):
    """LoRA on every ``q_proj``/``v_proj`` linear. Given ``model``, a projection that is no ``nn.Linear`` but wraps
    one as ``.linear`` (Gemma4's vision tower: ``Gemma4ClippableLinear``, which PEFT refuses to adapt) is excluded
    and its ``linear`` adapted instead."""
    from peft import LoraConfig

    # q_proj/v_proj exist only in the language model of Qwen-VL (the vision tower has a fused qkv).
    wrappers = [
        name
        for name, module in (model.named_modules() if model is not None else ())
        if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(getattr(module, "linear", None), torch.nn.Linear)
    ]
    targets = [*LORA_TARGETS, *(f"{t}.linear" for t in LORA_TARGETS)] if wrappers else list(LORA_TARGETS)
    return LoraConfig(
        r=params.lora_r,
        lora_alpha=params.lora_alpha,
        lora_dropout=0.0,
        target_modules=targets,
        exclude_modules=wrappers or None,
        task_type="CAUSAL_LM",
    )


def build_trainer(params: WorkbookParams, args: PAPOGConfig, model, processor, train_dataset, *, trainer_cls=None):
    """A PAPO-G trainer (``trainer_cls`` None: VPPOTrainer with ``method='vppo'``, else PAPOGTrainer); a plain
    model gets a fresh LoRA adapter (or, ``finetuning='full'``, trains every weight,
    the vision tower too unless ``freeze_vision_tower``), a PeftModel is trained as it is."""
    from peft import PeftModel

    if params.finetuning == "full" and not isinstance(model, PeftModel):
        peft_config = None
        if params.freeze_vision_tower:
            vision_tower(model).requires_grad_(False)
    else:
        peft_config = None if isinstance(model, PeftModel) else lora_config(params, model)
    # TRL draws a fresh LoRA adapter from the global RNG before Trainer.__init__ seeds it: seed here, or phase 1 of
    # every workbook starts from a different adapter in every process.
    torch.manual_seed(params.seed)
    trainer_cls = trainer_cls or (VPPOTrainer if params.method == "vppo" else PAPOGTrainer)
    return trainer_cls(
        model=model,
        processing_class=processor,
        reward_funcs=guarded_reward_functions(params),
        args=args,
        train_dataset=train_dataset,
        peft_config=peft_config,
    )


def vision_tower(model):
    """The vision encoder of a Qwen-VL model (``model.model.visual`` in transformers 5, ``model.visual`` before)."""
    for owner in (model, getattr(model, "model", None)):
        if owner is not None and hasattr(owner, "visual"):
            return owner.visual
    raise ValueError(f"parameter 'freeze_vision_tower': {type(model).__name__} has no 'visual' vision tower")


def prepare_training(params: WorkbookParams, output_dir: str | Path, *, report_to: str = "none", **config_overrides):
    """Model (fresh LoRA, or a trained adapter for phase 2), data and trainer, ready to ``train()``
    or to probe. Returns (trainer, held-out eval dataset, restored-adapter evidence or None). The data and the
    rewards are checked (each reward called on a group of completions of the first rows) before the model loads."""
    train_dataset, eval_dataset = load_datasets(params)
    check_rewards_on_groups(params, train_dataset, load_tokenizer(params))
    model, processor = load_policy(params)
    restored = None
    if params.init_adapter:
        model, restored = load_trainable_adapter(model, params.init_adapter)
    args = papo_config(params, output_dir, processor, report_to=report_to, **config_overrides)
    trainer = build_trainer(params, args, model, processor, train_dataset)
    rewards = [function.__name__ for _, function, _ in weighted_rewards(params)]
    trainer.add_callback(ModelCardCallback(params, str(resolve_model_path(params)), rewards))  # before the review's
    attach_review(trainer, params, train_dataset, eval_dataset)  # completions, checkpoint models, lineage (MLflow)
    if params.reference_policy == "base" and "ref" in getattr(trainer.model, "peft_config", {}):
        # TRL 1.9.1 copied the loaded adapter into a frozen "ref" adapter (beta != 0); without it, TRL computes the
        # reference with adapters disabled: the base model. (Before train(), so before accelerate wraps the model.)
        trainer.model.delete_adapter("ref")
    return trainer, eval_dataset, restored
