"""The in-loop benchmark's measurement: the variants' trainers on one shared model, their interleaved
``trainer.train()`` runs, the token shape and the FLOP model a layout is judged against. ``in_loop.py`` (its module
docstring describes the benchmark) is the command and the report."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from papo_nb.bench import harness
from papo_nb.bench.memory import status_kib
from papo_nb.prefix_sharing import attention_cost
from papo_nb.prefix_sharing.common import core_model
from papo_nb.prefix_sharing.grouped_attention import text_config

VARIANTS = ("grpo", "papo_rollout", "papo_update", "grpo_shared", "papo_shared")
FLOP_K = 3.0  # a training step's forward + backward, in forwards


@dataclass(frozen=True)
class Layout:
    group_size: int
    steps_per_round: int

    @property
    def name(self) -> str:
        return f"G{self.group_size}_k{self.steps_per_round}"


LAYOUTS = tuple(Layout(g, k) for g in (5, 8) for k in (1, 3))


class GenerateClock:
    """Wall and process CPU seconds spent inside ``model.generate`` (an instance attribute wrapping the method); while
    ``high_water_kib`` is a list, the resident high-water mark after each call is appended to it (``peak_mib``)."""

    def __init__(self, model):
        self.seconds = self.cpu_seconds = 0.0
        self.high_water_kib: list[int] | None = None
        inner = model.generate

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - wall
                self.cpu_seconds += time.process_time() - cpu
                if self.high_water_kib is not None:
                    self.high_water_kib.append(status_kib("VmHWM"))

        model.generate = timed


def model_setup(
    layout: Layout,
    *,
    family: str,
    size: str,
    n_prompts: int,
    steps: int,
    image_px: int,
    completion: int,
    seed: int,
    work: Path,
    cache_dir,
    device: str,
) -> harness.BenchSetup:
    """The tiny-family LoRA model (``family`` at ``size``) and its processor for ``layout``'s batches, on
    ``device``, its images at ``image_px``."""
    rows = n_prompts * layout.group_size
    settings = harness.bench_params(
        seed,
        n_prompts,
        model_name_or_path=f"tiny:{family}",
        num_generations=layout.group_size,
        per_device_train_batch_size=rows,
        max_completion_length=completion,
        max_steps=steps,
        learning_rate=1e-5,
    )
    setup = harness.tiny_setup(
        settings,
        size,
        seed=seed,
        cache_dir=cache_dir,
        work_dir=work,
        n_dataset=max(16, n_prompts * steps * layout.steps_per_round),
        started=time.perf_counter(),
    )
    # the shapes images are 56 px: resized to image_px, so the prompt is mostly image tokens, as in the paper
    setup.processor.image_processor.size = {"shortest_edge": image_px**2, "longest_edge": image_px**2}
    setup.model.to(device)
    return setup


def variant_trainers(
    setup: harness.BenchSetup,
    layout: Layout,
    variants: tuple[str, ...],
    *,
    completion: int,
    device: str,
    bf16: bool,
    sharing: bool | str = True,
) -> dict:
    """One trainer per name in ``variants`` on ``setup``'s model, each generating ``completion`` tokens exactly;
    ``sharing``: the shared variants' ``prefix_sharing`` (``"auto"``: measured as a run that leaves it to auto)."""
    from trl import GRPOTrainer

    from papo_nb.papo import PAPOGTrainer

    common = dict(
        steps_per_generation=layout.steps_per_round,
        logging_steps=1,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=bf16,
    )
    gamma_zero = dict(perception_loss_weight=0.0, original_entropy_weight=0.0, masked_entropy_weight=0.0)
    overrides = {
        "grpo": (GRPOTrainer, {}),
        "papo_rollout": (PAPOGTrainer, dict(masked_branch="rollout")),
        "papo_update": (PAPOGTrainer, dict(masked_branch="update")),
        "grpo_shared": (PAPOGTrainer, dict(prefix_sharing=sharing, **gamma_zero)),
        "papo_shared": (PAPOGTrainer, dict(masked_branch="rollout", prefix_sharing=sharing)),
    }
    trainers = {name: setup.trainer(name, overrides[name][0], **overrides[name][1], **common) for name in variants}
    for trainer in trainers.values():  # full-length completions: the same work whatever the weights
        trainer.generation_kwargs["min_new_tokens"] = completion
        trainer.generation_config.min_new_tokens = completion
    return trainers


def one_run(trainer, clock: GenerateClock, device: str, steps: int) -> dict[str, Any]:
    """One ``train()`` of ``steps`` optimizer steps; per-step numbers from its wall and process CPU time, the
    generate clock and the trainer's masked-branch clock (``*_cpu_s``: CPU seconds, robust to a shared machine)."""
    from papo_nb.papo import prefill as shared_prefix
    from papo_nb.prefix_sharing import sharing as prefix_sharing

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    branch = getattr(getattr(trainer, "masked_branch", None), "clock", None)
    before = (
        clock.seconds,
        clock.cpu_seconds,
        branch.seconds if branch else 0.0,
        branch.cpu_seconds if branch else 0.0,
    )
    trainer.args.max_steps = steps
    phases_before = trainer.phase_clock.snapshot() if hasattr(trainer, "phase_clock") else None
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    sync()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    n = trainer.state.global_step
    shares = [
        row[shared_prefix.SHARE_METRIC] for row in trainer.state.log_history if shared_prefix.SHARE_METRIC in row
    ]
    # the fraction of log-prob calls that ran packed (None: a trainer without prefix sharing, TRL's own)
    packed = [row[prefix_sharing.METRIC] for row in trainer.state.log_history if prefix_sharing.METRIC in row]
    generate, generate_cpu = clock.seconds - before[0], clock.cpu_seconds - before[1]
    masked = (branch.seconds - before[2]) if branch else 0.0
    masked_cpu = (branch.cpu_seconds - before[3]) if branch else 0.0
    phases = getattr(trainer, "phase_clock", None)  # per-phase CPU seconds where a benchmark attached a clock
    return dict(
        phases_cpu_s=None if phases is None else {k: v / n for k, v in phases.since(phases_before).items()},
        total_s=wall / n,
        no_sampling_s=(wall - generate) / n,
        masked_s=masked / n,
        generate_s=generate / n,
        total_cpu_s=cpu / n,
        no_sampling_cpu_s=(cpu - generate_cpu) / n,
        masked_cpu_s=masked_cpu / n,
        share=statistics.fmean(shares) if shares else None,
        packed=statistics.fmean(packed) if packed else (0.0 if hasattr(trainer, "prefix_sharing") else None),
        steps=n,
    )


def token_shape(trainer, dataset, n_prompts: int) -> dict[str, float]:
    """Mean prompt (image tokens included) and completion tokens of one generated round of ``n_prompts`` (a whole
    round: TRL's chunked log-prob pass indexes past a batch smaller than its chunk)."""
    from papo_nb.workbook.rollouts import rollout_batch

    batch = rollout_batch(trainer, dataset, n_prompts, seed=0)
    return dict(
        P=float(batch["prompt_mask"].sum(1).float().mean()), R=float(batch["completion_mask"].sum(1).float().mean())
    )


def flop_bound(P: float, R: float, G: int, k: float = FLOP_K) -> float:
    return 1.0 + (P + G * R) / (k * G * (P + R))


def flop_ratio(variant: str, P: float, R: float, G: int, steps_per_round: int, widths=None) -> float:
    """The FLOP model's ratio of ``variant`` to TRL's GRPO step without sampling: forward 1, backward 2, plus the
    old-log-prob forward at several steps per round (one device batch per step: TRL computes it then); the masked
    branch one shared forward; prefix sharing one grouped forward per prompt in every forward, not G plain rows.
    A shared forward costs ``rho`` plain ones: ``(P + G*R) / (G * (P + R))`` counting tokens, or with ``widths``
    (``attention_cost.TextWidths``) the text model's FLOPs, attention pairs included (``attention_cost.per_group``)."""
    forwards = FLOP_K + (1.0 if steps_per_round > 1 else 0.0)
    if widths is None:
        rho = (P + G * R) / (G * (P + R))
    else:
        # every completion runs to its full length here (min_new_tokens), so the plain rows carry no padding
        cost = attention_cost.per_group(widths, round(P), round(R), G, padded=False)
        rho = cost["grouped"] / cost["plain"]
    return {
        "grpo": 1.0,
        "papo_rollout": 1.0 + rho / forwards,
        "papo_update": 1.0 + rho / forwards,
        "grpo_shared": rho,
        "papo_shared": rho * (1.0 + 1.0 / forwards),
    }[variant]


def peak_mib(trainer, clock: GenerateClock, device: str, steps: int) -> tuple[float, float | None]:
    """Peak memory above the start of a ``train()`` of ``steps`` steps (one round: the rollout pass included): the
    CUDA allocator's peak on a GPU, resident memory on the CPU (``memory.rss_peak``; torch's profiler events, exact
    but kept per allocation, outgrew the machine at R 1024); and on the CPU the resident high-water mark reached by
    the end of the sampling call (which every variant makes alike), above the same start (None on a GPU)."""
    from papo_nb.bench.memory import cuda_peak, rss_peak

    trainer.args.max_steps = steps
    if device == "cuda":
        return cuda_peak(trainer.train)["peak_bytes"] / 2**20, None
    clock.high_water_kib = []
    try:
        measured = rss_peak(trainer.train)
    finally:
        sampled, clock.high_water_kib = max(clock.high_water_kib), None
    return measured["peak_bytes"] / 2**20, (sampled * 1024 - measured["rss_before_bytes"]) / 2**20


def peaks_mib(trainers: dict, clock: GenerateClock, args, steps: int) -> dict[str, dict[str, Any]]:
    """``args.memory_repeats`` peak measurements per variant, interleaved: their median and every run's peak and
    sampling high-water mark (a tiny model's RSS peaks differ by a few MiB from run to run)."""
    runs: dict[str, list[tuple[float, float | None]]] = {name: [] for name in trainers}
    for _ in range(args.memory_repeats):
        for name, trainer in trainers.items():
            runs[name].append(peak_mib(trainer, clock, args.device, steps))
    return {
        name: dict(
            peak_mib=statistics.median(peak for peak, _ in measured),
            peak_mib_runs=[peak for peak, _ in measured],
            sampling_peak_mib_runs=[sampled for _, sampled in measured],
        )
        for name, measured in runs.items()
    }


def interleaved_runs(trainers: dict, clock: GenerateClock, layout: Layout, args) -> dict[str, list[dict[str, Any]]]:
    """``args.repeats`` rounds of one ``train()`` per variant, the order rotated each round, after ``args.warmup``
    short untimed rounds (first-call costs off the clock); with ``args.deadline`` (``time.time()``, optional) no round
    starts that the last one's length says would end past it (at least one round runs)."""
    names = tuple(trainers)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(args.warmup):
        for name in names:
            one_run(trainers[name], clock, args.device, layout.steps_per_round)
    deadline, last = getattr(args, "deadline", None), 0.0
    for round_index in range(args.repeats):
        if deadline is not None and round_index and time.time() + last > deadline:
            break
        started = time.time()
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            runs[name].append(one_run(trainers[name], clock, args.device, args.steps))
        last = time.time() - started
    return runs


MEDIAN_KEYS = (
    "total_s",
    "no_sampling_s",
    "masked_s",
    "generate_s",
    "total_cpu_s",
    "no_sampling_cpu_s",
    "masked_cpu_s",
)


def median_run(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each timing over a variant's runs, and the mean masked-branch share where one was measured."""
    row: dict[str, Any] = {key: statistics.median(s[key] for s in samples) for key in MEDIAN_KEYS}
    for key in ("share", "packed"):
        measured = [s[key] for s in samples if s[key] is not None]
        row[key] = statistics.fmean(measured) if measured else None
    if samples[0].get("phases_cpu_s") is not None:
        phases = samples[0]["phases_cpu_s"]
        row["phases_cpu_s"] = {k: statistics.median(s["phases_cpu_s"][k] for s in samples) for k in phases}
    return row


def measure_layout(layout: Layout, args, work: Path) -> dict[str, Any]:
    setup = model_setup(
        layout,
        family=args.family,
        size=args.size,
        n_prompts=args.prompts,
        steps=args.steps,
        image_px=args.image_px,
        completion=args.completion,
        seed=args.seed,
        work=work,
        cache_dir=args.cache_dir,
        device=args.device,
    )
    trainers = variant_trainers(
        setup, layout, args.variants, completion=args.completion, device=args.device, bf16=args.bf16
    )
    model = setup.model
    clock = GenerateClock(model)
    papo = next(trainers[name] for name in args.variants if name != "grpo")
    shape = token_shape(papo, trainers["grpo"].train_dataset, args.prompts * layout.steps_per_round)
    runs = interleaved_runs(trainers, clock, layout, args)
    steps = layout.steps_per_round
    peaks = peaks_mib(trainers, clock, args, steps) if args.memory else {}
    out: dict[str, Any] = dict(
        layout=layout.name,
        G=layout.group_size,
        steps_per_round=layout.steps_per_round,
        rows_per_step=args.prompts * layout.group_size,
        n_params=setup.n_params,
        # as the timed train() calls left the model: TRL turns checkpointing on at train() start (its default)
        gradient_checkpointing=bool(core_model(model).is_activation_checkpointing),
        **shape,
    )
    out["flop_bound"] = flop_bound(shape["P"], shape["R"], layout.group_size)
    widths = attention_cost.TextWidths.of(text_config(core_model(model)))
    for name in args.variants:
        out[name] = median_run(runs[name])
        out[name].update(peaks.get(name, dict(peak_mib=None)))
        out[name]["flop_ratio"] = flop_ratio(name, shape["P"], shape["R"], layout.group_size, steps, widths)
        out[name]["flop_ratio_tokens"] = flop_ratio(name, shape["P"], shape["R"], layout.group_size, steps)
        plan = getattr(trainers[name], "forward_plan", None)  # as it stood after the runs (TRL's GRPO: none)
        out[name]["forward_plan"] = None if plan is None else plan.describe()
    stored = args.prompts * layout.group_size * layout.steps_per_round * shape["R"] * 4
    out["stored_branch_kib_per_round"] = stored / 1024  # rows x completion tokens fp32, what the rollout path keeps
    pairs = [(name, "grpo") for name in args.variants if name != "grpo"]
    if {"papo_shared", "papo_rollout"} <= set(args.variants):
        pairs.append(("papo_shared", "papo_rollout"))  # shared against plain PAPO-G, round by round
    for name, base in pairs:
        for key in ("total_s", "no_sampling_s", "total_cpu_s", "no_sampling_cpu_s"):
            per_round = [a[key] / b[key] for a, b in zip(runs[name], runs[base], strict=True)]
            out[f"{name}/{base}_{key}"] = dict(
                median=statistics.median(per_round), min=min(per_round), max=max(per_round)
            )
    return out
