"""Benchmark setup and the timed variants: one model, GRPO and PAPO-G trainers sharing it, one fixed batch.

The variants (``make_variants``) are what ``timing`` times and ``memory`` measures:

    grpo_step       a plain ``GRPOTrainer`` optimizer step: loss + backward + clip + AdamW step + zero_grad
    papo_step       the same step with ``PAPOGTrainer`` (masked branch under no-grad: the official default)
    papo_step_grad  the same with gradient through the masked branch (``masked_branch_grad=True``)
    extra_forward   one more forward alone: the parent's ``_get_per_token_logps_and_entropies`` under no_grad,
                    the floor of what PAPO-G must add to a step
    masking         ``PAPOGTrainer.masked_pixel_values`` alone
    probe_eval      one gamma-zero probe evaluation (``GammaZeroProbe.observe``) on the live batch's loss parts

Before each call the LoRA weights and the AdamW state are restored from one snapshot (and the mask generator is
reseeded), so every repeat of every variant does the same math from the same state.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from papo_nb.papo import PAPOGTrainer
from papo_nb.workbook.config.params import WorkbookParams

VARIANTS = ("grpo_step", "papo_step", "papo_step_grad", "extra_forward", "masking", "probe_eval")
STEP_VARIANTS = ("grpo_step", "papo_step", "papo_step_grad")
LABELS = {
    "grpo_step": "GRPO step",
    "papo_step": "PAPO-G step (masked branch no-grad)",
    "papo_step_grad": "PAPO-G step (grad through masked branch)",
    "extra_forward": "one extra forward (floor)",
    "masking": "masking alone",
    "probe_eval": "one probe evaluation",
    "papo_step_eta0": "PAPO-G step, eta1 = eta2 = 0 (memory only)",
}
SIZES = ("tiny", "wide")


# ------------------------------------------------------------------------------------------------
# setup: one model, three trainers on it, one fixed batch, one optimizer
# ------------------------------------------------------------------------------------------------


class StateSnapshot:
    """LoRA weights and AdamW state, restored in place (no allocation) before every timed call."""

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer):
        self.params = params
        self.optimizer = optimizer
        self.saved_params = [p.detach().clone() for p in params]
        # Create AdamW's state without running the model: a zero-gradient step, then undo its weight decay.
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.saved_state = {
            id(p): {k: v.clone() for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)} for p in params
        }
        self.restore()

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in zip(self.params, self.saved_params):
            p.copy_(saved)
            p.grad = None
        for p in self.params:
            for key, saved in self.saved_state[id(p)].items():
                self.optimizer.state[p][key].copy_(saved)


@dataclass
class BenchSetup:
    """One benchmark's setup, built once and shared by every benchmark (step overhead, paper shapes, the GPU check,
    in-loop): the LoRA model, its processor, a dataset and the settings the trainers share. ``trainer`` makes a
    trainer on the model; ``ready`` takes the fixed batch and makes the model ready to time (train mode, AdamW over
    the trainable parameters and their snapshot)."""

    size: str
    family: str
    seed: int
    model: Any
    processor: Any
    dataset: Any
    settings: WorkbookParams  # what the builder makes the trainers from (bench_params)
    work_dir: Path
    n_params: int
    started: float  # perf_counter when the setup began: ``setup_s`` counts from it
    trainers: dict[str, Any] = field(default_factory=dict)
    batch: dict[str, Any] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    snapshot: StateSnapshot | None = None
    n_trainable: int = 0
    setup_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def trainer(self, name: str, trainer_cls=None, **overrides):
        """A trainer on the shared (LoRA) model through the workbook's builder; ``overrides`` are config fields.

        ``trainer_cls`` GRPOTrainer is the baseline: it reads the GRPO fields of the same config and ignores
        PAPO-G's. ``prefix_sharing`` is False unless ``overrides`` set it."""
        from papo_nb.workbook.training.builder import build_trainer, papo_config

        # each variant measures the forward it names: prefix sharing only where it asks (the default "auto" would
        # pack the plain variants too)
        overrides = {"prefix_sharing": False, **overrides}
        args = papo_config(self.settings, self.work_dir / name, self.processor, save_strategy="no", **overrides)
        trainer = build_trainer(
            self.settings, args, self.model, self.processor, self.dataset, trainer_cls=trainer_cls or PAPOGTrainer
        )
        trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # set by train(); needed
        return trainer

    def ready(self, batch: dict[str, Any], *, lr: float | None = None) -> BenchSetup:
        """The fixed batch; the model in train mode, AdamW (``lr``, default the settings' learning rate) over its
        trainable parameters and their snapshot."""
        self.batch = batch
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.settings.learning_rate if lr is None else lr)
        self.snapshot = StateSnapshot(self.params, self.optimizer)
        self.n_trainable = sum(p.numel() for p in self.params)
        self.setup_s = time.perf_counter() - self.started
        return self

    def reset(self) -> None:
        self.snapshot.restore()
        for trainer in self.trainers.values():
            if hasattr(trainer, "mask_generator"):
                trainer.mask_generator.manual_seed(trainer.args.mask_seed)
            for mode_metrics in trainer._metrics.values():
                mode_metrics.clear()


def bench_params(seed: int = 0, n_prompts: int = 4, **fields) -> WorkbookParams:
    """The settings every benchmark trainer shares, as workbook parameters: the one builder turns them into configs.

    The fixed batch (``n_prompts`` x 4 completions) is also the trainers' own batch, so the in-training probe check
    sees the same size. lr 1e-3 moves a fresh LoRA within a few steps; beta 0 (no reference forward) and TRL's
    default loss aggregation (dapo) keep the GRPO step what TRL's defaults make it; the PAPO-G terms are at the
    paper's values (gamma 0.02, eta1 = eta2 = 0.03, whole patches masked at 0.6), stated here so that the
    benchmark measures the same step whatever the workbook's defaults become. ``fields`` change any of these.
    """
    settings = dict(
        model_name_or_path="tiny:qwen2_vl",
        seed=seed,
        learning_rate=1e-3,
        beta=0.0,
        loss_type="dapo",
        max_steps=4,
        per_device_train_batch_size=4 * n_prompts,
        num_generations=4,
        max_completion_length=16,
        perception_loss_weight=0.02,
        perception_loss_schedule="fixed",
        mask_type="auto",
        mask_ratio=0.6,
        original_entropy_weight=0.03,
        masked_entropy_weight=0.03,
        masked_branch_grad=False,
        require_gpu_contract_probe=False,
    )
    return WorkbookParams(**{**settings, **fields})


def tiny_setup(
    settings: WorkbookParams, size: str, *, seed: int, cache_dir, work_dir: Path, n_dataset: int, started: float,
    vocab_size: int | None = None,
) -> BenchSetup:  # fmt: skip
    """A ``BenchSetup`` on the tiny-family model (``settings.model_name_or_path``) of ``size`` with LoRA and a
    shapes dataset of ``n_dataset`` items; ``started`` is when the setup began (``perf_counter``); ``vocab_size``:
    the embeddings and LM head resized to it (a real model's vocabulary at tiny widths)."""
    from peft import get_peft_model

    from papo_nb.testbed.models import build_tiny_vlm, load_vlm
    from papo_nb.testbed.shapes import make_shapes_dataset
    from papo_nb.workbook.training.builder import lora_config

    family = settings.model_name_or_path.removeprefix("tiny:")
    model, processor = load_vlm(build_tiny_vlm(family, seed=seed, cache_dir=cache_dir, size=size))
    if vocab_size is not None:
        torch.manual_seed(seed)
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    n_params = sum(p.numel() for p in model.parameters())
    torch.manual_seed(seed)
    model = get_peft_model(model, lora_config(settings))
    dataset = make_shapes_dataset(n_dataset, seed=seed)
    return BenchSetup(size, family, seed, model, processor, dataset, settings, work_dir, n_params, started)


def build_setup(
    size: str,
    *,
    family: str = "qwen2_vl",
    seed: int = 0,
    cache_dir: str | Path | None = None,
    work_dir: str | Path | None = None,
    n_prompts: int = 4,
    batch: dict[str, Any] | None = None,
) -> BenchSetup:
    """The tiny-family model of ``size`` with LoRA, a GRPO and three PAPO-G trainers sharing it, and one batch."""
    from trl import GRPOTrainer

    from papo_nb.workbook.rollouts import rollout_batch

    started = time.perf_counter()
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="papo_bench_"))
    settings = bench_params(seed, n_prompts, model_name_or_path=f"tiny:{family}")
    setup = tiny_setup(
        settings, size, seed=seed, cache_dir=cache_dir, work_dir=work_dir, n_dataset=max(8, n_prompts), started=started
    )
    setup.trainers = {
        "grpo": setup.trainer("grpo", GRPOTrainer),
        # "update": the masked branch inside the timed step (a rollout-time branch would ride in with the batch)
        "papo": setup.trainer("papo", masked_branch="update"),
        "papo_grad": setup.trainer("papo_grad", masked_branch="update", masked_branch_grad=True),
        # memory only: PAPO-G without the entropy terms, to separate eta1's entropy gradient from the masked branch
        "papo_eta0": setup.trainer(
            "papo_eta0", masked_branch="update", original_entropy_weight=0.0, masked_entropy_weight=0.0
        ),
    }
    if batch is None:  # given: a batch this function made before (saved by the RSS measurement for its workers)
        batch = rollout_batch(setup.trainers["papo"], setup.dataset, n_prompts, seed=seed)
    return setup.ready(batch)


def batch_shape(batch: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    return dict(
        sequences=int(batch["completion_ids"].shape[0]),
        prompt_tokens=int(batch["prompt_ids"].shape[1]),
        completion_tokens=int(batch["completion_ids"].shape[1]),
        completion_tokens_unmasked=int(batch["completion_mask"].sum().item()),
        image_patches=int(batch["pixel_values"].shape[0]) if batch.get("pixel_values") is not None else 0,
        vocab_size=int(vocab_size),
    )


def synthetic_batch(
    processor,
    n_sequences: int,
    completion_tokens: int,
    *,
    vocab_size: int,
    image_size: int | None = None,
    group_size: int = 4,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """A ``_compute_loss`` batch without generation: real shapes-task prompts and images through ``processor``
    (left-padded as TRL pads them), random completion ids (no vision placeholders) of full length
    ``completion_tokens``, group-centred random advantages. For models too large to sample from in a benchmark."""
    from trl.data_utils import prepare_multimodal_messages

    from papo_nb.testbed.models import vision_special_token_ids
    from papo_nb.testbed.shapes import make_shapes_dataset

    n_prompts = -(-n_sequences // group_size)
    dataset = make_shapes_dataset(max(n_prompts, 3), seed=seed)
    encoded = []
    for i in range(n_sequences):
        example = dataset[i // group_size]
        image = example["image"] if image_size is None else example["image"].resize((image_size, image_size))
        messages = prepare_multimodal_messages(example["prompt"], images=[image])
        encoded.append(
            processor.apply_chat_template(
                [messages], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
            )
        )
    length = max(e["input_ids"].shape[1] for e in encoded)
    pad_id = processor.tokenizer.pad_token_id
    prompt_ids = torch.cat([left_pad_one(e, "input_ids", pad_id, length) for e in encoded])
    prompt_mask = torch.cat([left_pad_one(e, "attention_mask", 0, length) for e in encoded])
    mm_types = torch.cat([left_pad_one(e, "mm_token_type_ids", 0, length) for e in encoded])
    generator = torch.Generator().manual_seed(seed)
    special = torch.tensor(vision_special_token_ids(processor) + [pad_id, processor.tokenizer.eos_token_id])
    allowed = torch.arange(vocab_size)[~torch.isin(torch.arange(vocab_size), special)]
    completion_ids = allowed[torch.randint(0, len(allowed), (n_sequences, completion_tokens), generator=generator)]
    completion_mask = torch.ones_like(completion_ids)
    advantages = torch.randn(n_sequences, generator=generator)
    groups = advantages[: (n_sequences // group_size) * group_size].view(-1, group_size)
    advantages[: groups.numel()] = (
        (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    ).reshape(-1)
    batch = dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=advantages,
        num_items_in_batch=completion_mask.sum(),
        pixel_values=torch.cat([e["pixel_values"] for e in encoded]),
        image_grid_thw=torch.cat([e["image_grid_thw"] for e in encoded]),
        num_images=[1] * n_sequences,
        mm_token_type_ids=torch.cat([mm_types, torch.zeros_like(completion_ids)], dim=1),
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def left_pad_one(encoded: dict[str, Any], key: str, value: int, length: int) -> torch.Tensor:
    tensor = encoded[key]
    return torch.cat([torch.full((1, length - tensor.shape[1]), value, dtype=tensor.dtype), tensor], dim=1)


# ------------------------------------------------------------------------------------------------
# the timed pieces
# ------------------------------------------------------------------------------------------------


def optimizer_step(trainer, model, batch, params, optimizer, max_grad_norm: float = 1.0) -> float:
    """What ``Trainer.training_step`` + the optimizer do for one step, minus generation."""
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def extra_forward(trainer, model, batch):
    """The floor: one more forward of the policy on the batch, exactly as the parent runs it, without gradient."""
    from trl import GRPOTrainer

    from papo_nb.papo.logp_inputs import logp_call_arguments

    positional, vlm_kwargs = logp_call_arguments(batch)
    with torch.no_grad():
        return GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, *positional, compute_entropy=True, **vlm_kwargs
        )


@dataclass
class Variant:
    run: Callable[[], Any]
    prepare: Callable[[], None] = lambda: None
    cleanup: Callable[[], None] = lambda: None


def make_variants(
    setup: BenchSetup, names=VARIANTS, context: Callable[[], Any] = contextlib.nullcontext
) -> dict[str, Variant]:
    """The timed callables on ``setup``. ``context`` wraps every model call (e.g. bf16 autocast on a GPU)."""
    from papo_nb.papo.probe import GammaZeroProbe, ProbeFailure

    s, grpo, papo, papo_grad = setup, setup.trainers["grpo"], setup.trainers["papo"], setup.trainers["papo_grad"]
    probe_state: dict[str, Any] = {}

    def wrapped(fn):
        def run():
            with context():
                return fn()

        return run

    def step(trainer):
        return wrapped(lambda: optimizer_step(trainer, s.model, s.batch, s.params, s.optimizer))

    def prepare_probe():
        s.reset()
        with context():  # computed by the step anyway: untimed
            probe_state["parts"] = papo.papo_loss_parts(s.model, s.batch)

    def run_probe():
        parent_loss, terms = probe_state["parts"]
        probe = GammaZeroProbe(papo.args.probe_max_degenerate_batches)
        try:
            with context():
                probe.observe(papo, s.model, parent_loss, terms)
        except ProbeFailure:
            pass  # the evidence says why; timing is what is measured here
        probe_state["evidence"] = probe.evidence
        return probe.evidence

    all_variants = {
        "grpo_step": Variant(step(grpo), s.reset),
        "papo_step": Variant(step(papo), s.reset),
        "papo_step_grad": Variant(step(papo_grad), s.reset),
        "papo_step_eta0": Variant(step(s.trainers["papo_eta0"]), s.reset) if "papo_eta0" in s.trainers else None,
        "extra_forward": Variant(wrapped(lambda: extra_forward(grpo, s.model, s.batch)), s.reset),
        "masking": Variant(lambda: papo.masked_pixel_values(s.batch), s.reset),
        "probe_eval": Variant(run_probe, prepare_probe, lambda: probe_state.pop("parts", None)),
    }
    setup.extra["probe_state"] = probe_state
    return {name: all_variants[name] for name in names}
