"""Timing: interleaved repeats of the variants, their summaries and ratios, and the probe inside real training."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from papo_nb.bench.harness import BenchSetup, Variant

RUN_STEPS = 100  # the probe's cost is judged per 100-step run


def time_interleaved(
    variants: dict[str, Variant],
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], None] = lambda: None,
    cpu_out: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Round-robin: each variant once per round; ``warmup`` rounds are run and dropped. The collector is run
    before each call and kept off during it, so its pauses do not land on one variant. ``sync`` waits for the
    device (``torch.cuda.synchronize`` on a GPU) before the clock starts and stops. Returns wall-clock seconds;
    ``cpu_out``, if given, receives the process CPU seconds of the same calls (``time.process_time``)."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    if cpu_out is not None:
        cpu_out.update({name: [] for name in variants})
    for round_index in range(warmup + repeats):
        for name, variant in variants.items():
            variant.prepare()
            gc.collect()
            sync()
            gc.disable()
            try:
                start, cpu_start = time.perf_counter(), time.process_time()
                variant.run()
                sync()
                elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            finally:
                gc.enable()
            variant.cleanup()
            if round_index >= warmup:
                times[name].append(elapsed)
                if cpu_out is not None:
                    cpu_out[name].append(cpu_elapsed)
    return times


def summarise(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else (ordered[0],) * 3
    return dict(
        n=len(ordered),
        median=statistics.median(ordered),
        min=ordered[0],
        p25=q1,
        p75=q3,
        max=ordered[-1],
        iqr=q3 - q1,
        mean=statistics.fmean(ordered),
    )


def ratios(times: dict[str, list[float]]) -> dict[str, float]:
    med = {name: statistics.median(values) for name, values in times.items()}
    grpo, papo = med["grpo_step"], med["papo_step"]
    out = dict(
        papo_over_grpo=papo / grpo,
        papo_grad_over_grpo=med["papo_step_grad"] / grpo,
        floor_ratio=(grpo + med["extra_forward"]) / grpo,
        overhead_over_floor=(papo - grpo) / med["extra_forward"],
        grad_overhead_over_floor=(med["papo_step_grad"] - grpo) / med["extra_forward"],
        masking_fraction_of_step=med["masking"] / papo,
        probe_eval_over_step=med["probe_eval"] / papo,
        probe_fraction_of_100_steps=med["probe_eval"] / (RUN_STEPS * papo),
        # the same ratios paired round by round (each round's variants ran back to back): robust to slow drift
        paired_papo_over_grpo=statistics.median(p / g for p, g in zip(times["papo_step"], times["grpo_step"])),
        paired_floor_ratio=statistics.median((g + f) / g for g, f in zip(times["grpo_step"], times["extra_forward"])),
        # ratios of the fastest repeats: the least disturbed by other load on the machine
        min_papo_over_grpo=min(times["papo_step"]) / min(times["grpo_step"]),
        min_floor_ratio=(min(times["grpo_step"]) + min(times["extra_forward"])) / min(times["grpo_step"]),
    )
    out["papo_over_grpo_minus_floor"] = out["papo_over_grpo"] - out["floor_ratio"]
    out["paired_papo_minus_floor"] = out["paired_papo_over_grpo"] - out["paired_floor_ratio"]
    out["min_papo_minus_floor"] = out["min_papo_over_grpo"] - out["min_floor_ratio"]
    return out


def probe_calls(probe) -> dict[str, int]:
    """How much probe code ran in a trainer: batches observed and batches measured, read from its probe object (none
    when the run built no probe, so nothing of it can have run)."""
    if probe is None:
        return {"observe": 0, "measure": 0}
    return {"observe": probe.evaluations, "measure": probe.measurements}


def training_probe_checks(setup: BenchSetup, steps: int) -> dict[str, Any]:
    """Real ``trainer.train()`` runs (generation included) on the same model: with the probe off, count probe
    calls (must be 0); with it on, time every ``observe`` call. LoRA weights are restored afterwards."""
    out: dict[str, Any] = {"train_steps": steps}
    off = setup.trainer("train_probe_off", max_steps=steps, require_gpu_contract_probe=False)
    start = time.perf_counter()
    off.train()
    out["probe_off"] = dict(
        train_s=time.perf_counter() - start,
        probe_object=off.probe is not None,
        probe_calls=probe_calls(off.probe),
    )
    setup.snapshot.restore()

    on = setup.trainer("train_probe_on", max_steps=steps, require_gpu_contract_probe=True)
    observe, observe_times, observe_cpu = on.probe.observe, [], []

    def timed_observe(*args, **kwargs):
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            return observe(*args, **kwargs)
        finally:
            observe_times.append(time.perf_counter() - start)
            observe_cpu.append(time.process_time() - cpu_start)

    on.probe.observe = timed_observe
    start = time.perf_counter()
    on.train()
    train_s = time.perf_counter() - start
    step_times = [h["step_time"] for h in on.state.log_history if "step_time" in h]
    evidence = on.probe.evidence.to_dict() if on.probe.evidence else None
    out["probe_on"] = dict(
        train_s=train_s,
        evaluations=on.probe.evaluations,
        observe_s=observe_times,
        probe_total_s=sum(observe_times),
        observe_cpu_s=observe_cpu,
        probe_total_cpu_s=sum(observe_cpu),
        passed=bool(on.probe.evidence and on.probe.evidence.passed),
        probe_calls=probe_calls(on.probe),
        logged_step_time_s=step_times,
        evidence={
            k: evidence[k]
            for k in (
                "status",
                "parent_grad_norm",
                "grad_diff_norm",
                "grad_diff_relative",
                "perception_kl",
                "leak_detection_power",
                "weakest_margin_at_recipe_gamma",
            )
        }
        if evidence
        else None,
    )
    setup.snapshot.restore()
    return out
