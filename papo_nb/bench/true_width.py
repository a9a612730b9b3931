"""Prefix sharing and the masked branch at true widths, inside ``trainer.train()``.

Each cell is a random-weight model built from a published configuration (``rehearsal.rehearsal_model``: the true
hidden, intermediate, head and vocabulary widths, K decoder layers and K vision blocks), with LoRA (or full
fine-tuning), bf16 autocast on the CPU, TRL's default gradient checkpointing, G completions of one prompt per
optimizer step forced to their full length, the recipe's prompt (``math_perception``) over one image of exactly
``max_pixels``, beta 0.01 (the recipe's KL term: a reference forward per round) and one optimizer step per round.
Three variants train side by side on the one model, interleaved round by round, one thread (``in_loop_measure``):

    grpo          TRL's GRPOTrainer
    papo_rollout  PAPOGTrainer, masked branch once per round (plain PAPO-G)
    papo_shared   the same with ``prefix_sharing="auto"``: what a run that leaves it to auto gets

Times are process CPU seconds per optimizer step without the sampling call (robust to a shared machine), with the
phases apart (``PhaseClock``). Beside each ratio stands the FLOP model's (``true_width_model``), per phase, and
``auto``'s decision as the run made it. ``true_width_report`` renders the JSON into docs/performance.md.

    python -m papo_nb.bench.true_width --out docs/in_loop/true_width.json
    python -m papo_nb.bench.true_width --remodel docs/in_loop/true_width.json   # the model again, nothing timed
    python -m papo_nb.bench.true_width --rates    # one thread's rate of the vision tower and the vocabulary head
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from papo_nb.bench import harness
from papo_nb.bench import true_width_model as flop_model
from papo_nb.bench.in_loop_measure import (
    GenerateClock,
    Layout,
    interleaved_runs,
    median_run,
    one_run,
    peaks_mib,
    variant_trainers,
)
from papo_nb.bench.memory import rss_peak
from papo_nb.bench.rehearsal import contiguous_head_input, rehearsal_model
from papo_nb.bench.rehearsal_measure import wrap_method

QWEN25_3B = "Qwen/Qwen2.5-VL-3B-Instruct"
MIN_PIXELS = 200704  # the recipe's (params/recipes/papo_g_3b.yaml)
VARIANTS = ("grpo", "papo_rollout", "papo_shared")
MERGED_PATCH = 28  # Qwen2.5-VL: 14-pixel patches merged 2 x 2


@dataclass(frozen=True)
class Cell:
    family: str = QWEN25_3B
    layers: int = 1
    num_generations: int = 5
    max_pixels: int = 1003520
    completion_length: int = 256
    finetuning: str = "lora"

    @property
    def name(self) -> str:
        tail = "" if self.finetuning == "lora" else f"-{self.finetuning}"
        return (
            f"{self.family.rsplit('/', 1)[-1]}-K{self.layers}-G{self.num_generations}-px{self.max_pixels}"
            f"-R{self.completion_length}{tail}"
        )


REQUIRED = (Cell(completion_length=256), Cell(completion_length=1024))


class PhaseClock:
    """Process CPU seconds of one trainer's phases, attached from outside (instance attributes wrapping its methods):
    ``loss_forward`` (``compute_loss``), ``backward`` (checkpointing's recompute included) and ``round_logps`` (the
    round beyond sampling and the masked branch: the reference log-probs, rewards, advantages, auto's check)."""

    def __init__(self, trainer, generate_clock: GenerateClock, name: str = ""):
        self.name = name
        self.seconds = {"loss_forward": 0.0, "backward": 0.0, "round_logps": 0.0}
        self.tokens: dict[str, float] = {}  # the last round's mean prompt (image included) and completion tokens
        self.peaks_mib: list[float] | None = None  # a list: each train()'s resident high-water mark above its start
        wrap_method(trainer, "train", self.train)
        self.generate_clock = generate_clock
        self.branch = getattr(getattr(trainer, "masked_branch", None), "clock", None)
        wrap_method(trainer, "compute_loss", self.timed("loss_forward"))
        wrap_method(trainer.accelerator, "backward", self.timed("backward"))
        wrap_method(trainer, "_generate_and_score_completions", self.round)
        trainer.phase_clock = self

    def timed(self, phase: str):
        def around(original, *args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.process_time() - start

        return around

    def train(self, original, *args, **kwargs):
        if self.peaks_mib is None:
            return original(*args, **kwargs)
        out = {}
        measured = rss_peak(lambda: out.setdefault("result", original(*args, **kwargs)))
        self.peaks_mib.append(measured["peak_bytes"] / 2**20)
        return out["result"]

    def inner(self) -> float:
        return self.generate_clock.cpu_seconds + (self.branch.cpu_seconds if self.branch else 0.0)

    def round(self, original, *args, **kwargs):
        start, inner = time.process_time(), self.inner()
        batch = original(*args, **kwargs)
        self.seconds["round_logps"] += time.process_time() - start - (self.inner() - inner)
        print(f"  {self.name}: round {time.process_time() - start:.0f} CPU s", file=sys.stderr, flush=True)
        self.tokens = {
            "P": float(batch["prompt_mask"].sum(1).float().mean()),
            "R": float(batch["completion_mask"].sum(1).float().mean()),
        }
        return batch

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        return {k: v - before[k] for k, v in self.seconds.items()}


def recipe_rows(n: int, max_pixels: int):
    """``n`` rows in TRL's conversational format: the recipe's prompt (``math_perception`` around a question) and
    one image of exactly ``max_pixels`` in whole merged patches (the processor keeps it as it is)."""
    import datasets
    from PIL import Image

    from papo_nb.workbook.recipe.data import format_template

    merged = max_pixels // MERGED_PATCH**2
    short = max(d for d in range(1, int(merged**0.5) + 1) if merged % d == 0)
    size = (MERGED_PATCH * (merged // short), MERGED_PATCH * short)
    text = format_template("math_perception").render(content="How many shapes are there in the picture?")
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return datasets.Dataset.from_dict(
        {
            "prompt": [prompt] * n,
            "image": [Image.new("RGB", size, (40 * i % 255, 90, 200)) for i in range(n)],
            "answer": ["3"] * n,
            "kind": ["count"] * n,
        }
    )


def cell_setup(cell: Cell, *, seed: int, work: Path, rows: int = 8) -> harness.BenchSetup:
    """The cell's random-weight model (LoRA or full), its processor, the recipe rows and the trainers' settings."""
    from peft import get_peft_model

    from papo_nb.workbook.training.builder import lora_config

    started = time.perf_counter()
    model, processor = rehearsal_model(
        cell.family, cell.layers, seed=seed, min_pixels=MIN_PIXELS, max_pixels=cell.max_pixels
    )
    n_params = sum(p.numel() for p in model.parameters())
    settings = harness.bench_params(
        seed,
        1,
        model_name_or_path=cell.family,
        num_generations=cell.num_generations,
        per_device_train_batch_size=cell.num_generations,
        max_completion_length=cell.completion_length,
        max_steps=1,
        learning_rate=1e-6,
        beta=0.01,  # the recipe's KL term: the reference log-probs are a phase of every round
        loss_type="bnpo",
        min_pixels=MIN_PIXELS,
        max_pixels=cell.max_pixels,
        finetuning=cell.finetuning,
    )
    if cell.finetuning == "lora":
        torch.manual_seed(seed)
        model = get_peft_model(model, lora_config(settings, model))
    contiguous_head_input(model)  # the reference model of a full fine-tune gets the same hook (measure_cell)
    dataset = recipe_rows(rows, cell.max_pixels)
    return harness.BenchSetup("true", cell.family, seed, model, processor, dataset, settings, work, n_params, started)


def reference_without_adapter(setup: harness.BenchSetup) -> None:
    """Every trainer on the one LoRA model takes its reference log-probs with the adapters disabled. TRL gives a
    PEFT model it is handed at beta > 0 a frozen "ref" copy of the adapter, one per model: the next trainer's copy
    would collide. Without it TRL disables the adapters (its own path where the copy cannot be made): the same
    forward, and at the fresh adapter's zero update the same numbers."""
    build = setup.trainer

    def trainer(*args, **kwargs):
        made = build(*args, **kwargs)
        if "ref" in getattr(setup.model, "peft_config", {}):
            setup.model.delete_adapter("ref")
        return made

    setup.trainer = trainer


def ratio_spread(runs: dict, name: str, base: str, key: str = "no_sampling_cpu_s") -> dict[str, Any]:
    per_round = [a[key] / b[key] for a, b in zip(runs[name], runs[base], strict=True)]
    return dict(median=statistics.median(per_round), min=min(per_round), max=max(per_round), rounds=per_round)


def auto_decision(trainer) -> str:
    """What ``prefix_sharing="auto"`` did in the timed rounds: ``shared`` where every log-prob call ran packed."""
    packed = [row["papo/prefix_shared"] for row in trainer.state.log_history if "papo/prefix_shared" in row]
    if packed and min(packed) == 1.0:
        return "shared"
    return f"plain ({trainer.forward_plan.log_prob_reason})"


def measure_cell(cell: Cell, args, work: Path) -> dict[str, Any]:
    """One cell: the variants' interleaved rounds, their peaks, the ratios with their spread, the FLOP model's
    prediction per phase and auto's decision."""
    from papo_nb.prefix_sharing.common import core_model

    setup = cell_setup(cell, seed=args.seed, work=work)
    reference_without_adapter(setup)
    layout = Layout(cell.num_generations, 1)
    trainers = variant_trainers(
        setup, layout, VARIANTS, completion=cell.completion_length, device="cpu", bf16=True, sharing="auto"
    )
    clock = GenerateClock(setup.model)
    for name, trainer in trainers.items():
        PhaseClock(trainer, clock, name)
        if getattr(trainer, "ref_model", None) is not None:  # a full fine-tune's own reference copy
            contiguous_head_input(trainer.ref_model)
    runs, peaks, peak_source = warm_and_time(trainers, clock, layout, args)
    shape = trainers["papo_shared"].phase_clock.tokens
    config = core_model(setup.model).config
    record: dict[str, Any] = dict(
        asdict(cell),
        cell=cell.name,
        repeats=args.repeats,
        n_params=setup.n_params,
        gradient_checkpointing=bool(core_model(setup.model).is_activation_checkpointing),
        P=shape["P"],
        R=shape["R"],
        peak_source=peak_source,
        variants={},
    )
    for name in VARIANTS:
        plan = getattr(trainers[name], "forward_plan", None)  # as it stood after the runs (TRL's GRPO: none)
        record["variants"][name] = {
            **median_run(runs[name]),
            **peaks[name],
            "forward_plan": None if plan is None else plan.describe(),
        }
    record["shared_over_plain"] = ratio_spread(runs, "papo_shared", "papo_rollout")
    record["shared_over_grpo"] = ratio_spread(runs, "papo_shared", "grpo")
    record["plain_over_grpo"] = ratio_spread(runs, "papo_rollout", "grpo")
    record["phase_ratios"] = phase_ratios(record["variants"])
    record["auto_decision"] = auto_decision(trainers["papo_shared"])
    return with_model(record, config)


def with_model(record: dict[str, Any], config=None) -> dict[str, Any]:
    """``record`` with the FLOP model's prediction at its cell and measured P and R (``config``: the cell's model
    configuration, default the published one at the cell's depth)."""
    from papo_nb.workbook.recipe.architectures import published_config, with_depth

    cell = Cell(**{key: record[key] for key in Cell.__dataclass_fields__})
    config = config or with_depth(published_config(cell.family), cell.layers)
    record["model"] = flop_model.prediction(config, cell, record["P"], record["R"])
    record["model_shared_over_plain"] = record["model"]["step"]["shared_over_plain"]
    return record


def warm_and_time(trainers: dict, clock: GenerateClock, layout: Layout, args) -> tuple[dict, dict, str]:
    """The warm-up and the timed rounds: ``(runs, peaks, how the peaks were measured)``. By default the warm-up is
    the peak measurement, one untimed train() per variant (first-call costs and auto's first-batch check off the
    clock). With ``args.light_warmup`` (a cell too long for a whole warm-up round in the time there is) only the
    shared variant warms up (auto's check), and each variant's peak is the median of its timed train() calls'
    (``rss_peak``: its 128 KiB mmap threshold in force during every variant's timed calls alike)."""
    if not args.light_warmup:
        peaks = peaks_mib(trainers, clock, args, 1)
        return interleaved_runs(trainers, clock, layout, args), peaks, "warm-up train(), rss_peak"
    one_run(trainers["papo_shared"], clock, "cpu", 1)
    for trainer in trainers.values():
        trainer.phase_clock.peaks_mib = []
    runs = interleaved_runs(trainers, clock, layout, args)
    peaks = {}
    for name, trainer in trainers.items():
        measured, trainer.phase_clock.peaks_mib = trainer.phase_clock.peaks_mib, None
        peaks[name] = dict(peak_mib=statistics.median(measured), peak_mib_runs=measured)
    return runs, peaks, "timed train() calls, rss_peak"


def phase_ratios(variants: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Shared over plain PAPO-G per phase, from the medians of each phase's CPU seconds."""
    shared, plain = variants["papo_shared"]["phases_cpu_s"], variants["papo_rollout"]["phases_cpu_s"]
    out: dict[str, float | None] = {}
    for phase in shared:
        out[phase] = shared[phase] / plain[phase] if plain[phase] > 0 else None
    train = ("loss_forward", "backward")
    out["training"] = sum(shared[p] for p in train) / sum(plain[p] for p in train)
    masked = variants["papo_shared"]["masked_cpu_s"], variants["papo_rollout"]["masked_cpu_s"]
    out["masked"] = masked[0] / masked[1] if masked[1] > 0 else None
    return out


def parse_cells(text: str) -> list[Cell]:
    """``--cells``: ``required`` or entries ``K:G:pixels:R[:full]`` separated by commas (Qwen2.5-VL-3B)."""
    cells: list[Cell] = []
    for entry in text.split(","):
        if entry == "required":
            cells.extend(REQUIRED)
            continue
        parts = entry.split(":")
        if len(parts) not in (4, 5) or not all(p.isdigit() for p in parts[:4]) or parts[4:] not in ([], ["full"]):
            raise ValueError(f"--cells entry {entry!r}: allowed 'required' or K:G:pixels:R[:full], e.g. 1:8:200704:64")
        k, g, px, r = map(int, parts[:4])
        cells.append(Cell(layers=k, num_generations=g, max_pixels=px, completion_length=r,
                          finetuning="full" if parts[4:] else "lora"))  # fmt: skip
    return cells


def deadline_epoch(text: str, parser: argparse.ArgumentParser) -> float:
    """``--deadline HH:MM`` (UTC) as epoch seconds: today's, or tomorrow's if today's has passed."""
    import datetime as dt

    try:
        hour, minute = (int(x) for x in text.split(":"))
        now = dt.datetime.now(dt.UTC)
        when = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    except ValueError:
        parser.error(f"--deadline={text!r}: allowed a UTC time HH:MM, e.g. 00:35")
    return (when if when > now else when + dt.timedelta(days=1)).timestamp()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="required", help="'required' and/or K:G:pixels:R[:full], comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed interleaved rounds per cell")
    parser.add_argument("--long-repeats", type=int, default=None, help="rounds of cells at R >= 1024 (default: same)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--append", action="store_true", help="add the cells to --out's kept cells (one run each)")
    parser.add_argument("--light-warmup", action="store_true", help="warm up the shared variant alone (see below)")
    parser.add_argument("--deadline", default=None, help="UTC HH:MM: no timed round starts that would end after it")
    args = parser.parse_args(argv)
    try:
        args.cells = parse_cells(args.cells)
    except ValueError as exc:
        parser.error(str(exc))
    args.long_repeats = args.long_repeats or args.repeats
    if args.deadline is not None:
        args.deadline = deadline_epoch(args.deadline, parser)
    if min(args.repeats, args.long_repeats) < 1:
        parser.error(f"--repeats={args.repeats} --long-repeats={args.long_repeats}: at least 1 each")
    # what in_loop_measure's interleaved rounds and peaks read: the peak round is the warm-up
    args.steps, args.device, args.memory_repeats, args.warmup = 1, "cpu", 1, 0
    return args


def part_rates(seed: int = 0) -> dict[str, float]:
    """One thread's no-grad rate (GFLOP/s, bf16 autocast) of the step model's parts at Qwen2.5-VL-3B widths, K 1: the
    vision tower on one 1,003,520-pixel image and the vocabulary head on 1,280 positions (G 5 x R 256), and the
    seconds of TRL's fp32 log-softmax over those positions' logits (work the FLOP model does not count)."""
    from papo_nb.prefix_sharing import attention_cost

    torch.set_num_threads(1)
    model, _ = rehearsal_model(QWEN25_3B, 1, seed=seed, min_pixels=MIN_PIXELS, max_pixels=1003520)
    text = model.config.get_text_config()
    grid, positions = torch.tensor([[1, 64, 80]]), 1280  # 5,120 patches of 14 pixels
    pixels = torch.randn(5120, 3 * 2 * 14 * 14, dtype=torch.bfloat16)
    hidden = torch.randn(positions, text.hidden_size, dtype=torch.bfloat16)

    def seconds(run) -> float:
        run()  # first call off the clock
        start = time.process_time()
        run()
        return time.process_time() - start

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        vision = seconds(lambda: model.model.visual(pixels, grid_thw=grid))
        head = seconds(lambda: model.lm_head(hidden))
        logits = model.lm_head(hidden).float()
        softmax = seconds(lambda: torch.log_softmax(logits, -1))
    image = attention_cost.VisionWidths.of(model.config.vision_config).image_flops(5120)
    return dict(
        vision_gflops=image / vision / 1e9,
        head_gflops=attention_cost.TextWidths.of(text).head_flops(positions) / head / 1e9,
        log_softmax_s=softmax,
    )


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--rates"]:  # the parts' kernel rates on this machine, nothing trained
        print(json.dumps(part_rates(), indent=1))
        return 0
    if argv[:1] == ["--remodel"]:  # the FLOP model again over a kept measurement (its P and R), nothing timed
        path = Path(argv[1])
        results = json.loads(path.read_text())
        results["cells"] = [with_model(record) for record in results["cells"]]
        path.write_text(json.dumps(results, indent=1))
        return 0
    args = parse_args(argv)
    torch.set_num_threads(1)
    kept = args.append and args.out is not None and args.out.exists()
    results = json.loads(args.out.read_text()) if kept else dict(clock="cpu", threads=1, cells=[], runs=[])
    run: dict[str, Any] = dict(
        command=" ".join(["python -m papo_nb.bench.true_width", *argv]),
        threads=torch.get_num_threads(),
        omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
        warmup="the peak measurement: one untimed train() per variant",
        load_before=[round(x, 2) for x in os.getloadavg()],
        cells=[cell.name for cell in args.cells],
    )
    results["runs"].append(run)
    results["threads"] = max(r["threads"] for r in results["runs"])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="papo_true_width_") as work:
        for cell in args.cells:
            rounds = args.long_repeats if cell.completion_length >= 1024 else args.repeats
            cell_args = argparse.Namespace(**{**vars(args), "repeats": rounds})
            results["cells"].append(measure_cell(cell, cell_args, Path(work) / cell.name))
            run["wall_s"] = time.perf_counter() - started
            if args.out:  # after every cell: a run cut short keeps what it measured
                args.out.write_text(json.dumps(results, indent=1))
            print(f"{cell.name} done at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    run["load_after"] = [round(x, 2) for x in os.getloadavg()]
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
