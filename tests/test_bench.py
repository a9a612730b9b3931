"""The step-overhead benchmark and the GPU check's CPU dry run produce well-formed reports.

Timings are not checked (2-core CI machines are noisy): keys, positive medians, finite ratios, and the probe-call
counts of a real ``trainer.train()`` with the probe off (no probe code at all) and on (one evaluation).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from papo_nb.bench.harness import STEP_VARIANTS, VARIANTS
from papo_nb.bench.main import add_bench_arguments

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(cmd, tmp_path, timeout=240):
    env = {**os.environ, "PAPO_NB_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bench")
    out = tmp_path / "report.json"
    done = run(
        [
            "benchmarks/step_overhead.py",
            "--quick",
            "--sizes",
            "tiny",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--n-prompts",
            "2",
            "--train-steps",
            "2",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "table.md"),
        ],
        tmp_path,
    )
    return json.loads(out.read_text()), done.stdout, (tmp_path / "table.md").read_text()


def test_quick_report_is_well_formed(quick_report):
    report, stdout, table = quick_report
    assert report["mode"] == "quick" and report["environment"]["threads"] == 1
    result = report["sizes"]["tiny"]
    assert set(result["timings"]) == set(VARIANTS)
    for name, summary in result["timings"].items():
        assert summary["n"] == 2 and len(result["samples_s"][name]) == 2
        assert 0 < summary["min"] <= summary["p25"] <= summary["median"] <= summary["p75"] <= summary["max"], name
    ratios = result["ratios"]
    for key in (
        "papo_over_grpo",
        "floor_ratio",
        "overhead_over_floor",
        "papo_grad_over_grpo",
        "paired_papo_over_grpo",
        "paired_floor_ratio",
        "min_papo_over_grpo",
        "masking_fraction_of_step",
        "probe_fraction_of_100_steps",
    ):
        assert math.isfinite(ratios[key]) and ratios[key] > 0 or key == "overhead_over_floor", key
    assert ratios["floor_ratio"] > 1
    assert result["params"] > 0 and result["batch"]["sequences"] == 8 and result["batch"]["image_patches"] > 0
    assert result["probe_eval_evidence"]["status"] == "passed"
    for name in report["targets"]:
        assert isinstance(report["targets"][name]["ok"], bool)
    assert "| tiny (0.20M) | GRPO step |" in stdout and "PAPO-G / GRPO" in stdout and "total " in stdout
    assert table.startswith("| model | variant | CPU median ms")
    assert set(result["cpu_timings"]) == set(VARIANTS) and result["cpu_ratios"]["floor_ratio"] > 1


def test_memory_shows_no_second_logits_tensor_from_the_no_grad_branch(quick_report):
    memory = quick_report[0]["sizes"]["tiny"]["memory"]
    assert set(STEP_VARIANTS) <= set(memory)
    for name in (*STEP_VARIANTS, "extra_forward"):
        assert memory[name]["alloc_peak_mib"] > 0 and memory[name]["vocab_bytes_peak"] > 0
    # With the masked branch no-grad and no entropy terms, PAPO-G's peaks are the GRPO step's, exactly.
    assert memory["papo_step_eta0"]["vocab_bytes_peak"] == memory["grpo_step"]["vocab_bytes_peak"]
    assert memory["papo_step_eta0"]["full_logits_alive_peak"] == memory["grpo_step"]["full_logits_alive_peak"]
    # Gradient through the masked branch keeps its graph: more memory than the no-grad default.
    assert memory["papo_step_grad"]["alloc_peak_mib"] > memory["papo_step"]["alloc_peak_mib"]


def test_no_probe_code_runs_in_training_when_not_required(quick_report):
    training = quick_report[0]["sizes"]["tiny"]["probe_training"]
    assert training["probe_off"]["probe_calls"] == {"observe": 0, "measure": 0}
    assert training["probe_off"]["probe_object"] is False
    on = training["probe_on"]
    assert on["passed"] and on["evaluations"] == 1 and on["probe_calls"] == {"observe": 1, "measure": 1}
    assert len(on["observe_s"]) == 1 and on["probe_total_s"] > 0 and on["fraction_of_100_steps"] > 0
    targets = quick_report[0]["targets"]
    assert targets["no_probe_code_when_not_required"]["ok"]


def test_gpu_check_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu"
    run(
        ["benchmarks/gpu_check.py", "--cpu-dry-run", "--out-dir", str(out), "--repeats", "2", "--probe-batches", "1"],
        tmp_path,
    )
    report = json.loads((out / "gpu_check.json").read_text())
    assert set(report["timings"]) == set(VARIANTS)
    assert all(t["median"] > 0 for t in report["timings"].values())
    assert report["ratios"]["papo_over_grpo"] > 0 and report["tokens_per_s"]["grpo_step"] > 0
    assert report["batch"]["vocab_size"] == 1024 and report["model"]["dtype"] == "bfloat16"
    point = report["probe"][0]
    assert point["status"] == "passed" and point["autocast_dtype"] == "bfloat16"
    for key in ("parent_grad_norm", "grad_diff_norm", "grad_diff_relative", "tolerance", "injected_leak_diff"):
        assert math.isfinite(point[key]) and point[key] >= 0, key
    assert point["injected_leak_diff"] > point["tolerance"]
    assert report["memory"] == {"skipped": "not on CUDA"}


def test_bench_arguments_parse_for_the_cli():
    import argparse

    args = add_bench_arguments(argparse.ArgumentParser()).parse_args(["--quick", "--sizes", "tiny", "--out", "x.json"])
    assert args.quick and args.sizes == "tiny" and str(args.out) == "x.json" and args.threads == 1


def test_work_accounting_shows_one_extra_forward(quick_report):
    work = quick_report[0]["sizes"]["tiny"]["work"]
    assert work["grpo_step"]["gflop"] > 0 and work["extra_forward"]["gflop"] > 0
    # PAPO-G's matmul work is GRPO's plus less than one forward (profiler FLOP counts are deterministic): the default
    # masked branch prefills each prompt once for its 4 completions (shared prefix, issue 14) instead of 4 times.
    assert -work["extra_forward"]["gflop"] < work["papo_extra_gflop"] < -1e-3 * work["papo_step"]["gflop"]
    assert work["papo_grad_extra_gflop_over_floor"] > 0  # the masked branch's backward


def test_trl_memory_refuses_a_single_release_by_name(capsys):
    """``python -m papo_nb.bench.trl_memory`` compares releases: one virtualenv is refused before any work."""
    from papo_nb.bench.trl_memory import main

    with pytest.raises(SystemExit) as info:
        main(["--python", sys.executable])
    assert info.value.code == 2
    assert "--python given 1 time(s): give one virtualenv Python per release, at least 2" in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_rss_peak_follows_live_memory_not_what_the_allocator_kept():
    """The in-loop benchmark's CPU peak: a 64 MiB tensor made and freed reads as about 64 MiB every time (freed blocks
    leave RSS, so a second call is not hidden by memory the allocator kept), and a call that allocates nothing as
    about 0."""
    import torch

    from papo_nb.bench.memory import rss_peak

    def allocate():
        block = torch.ones(64 * 2**20 // 4)
        del block

    peaks = [rss_peak(allocate)["peak_bytes"] / 2**20 for _ in range(2)]
    idle = rss_peak(lambda: None)["peak_bytes"] / 2**20
    print(f"\nrss_peak: 64 MiB block {peaks} MiB, nothing {idle:.2f} MiB")
    assert all(62 <= peak <= 72 for peak in peaks), peaks
    assert idle < 4, idle


@pytest.mark.parametrize(
    "asked, restored",
    [("131072", 131072), ("4294967296", 2**31 - 1), (None, 32 * 2**20), ("off", 32 * 2**20)],
)
def test_rss_peak_restores_the_threshold_the_process_started_with(monkeypatch, asked, restored):
    """After the measurement the mmap threshold goes back to ``MALLOC_MMAP_THRESHOLD_`` (capped at ``mallopt``'s
    int, 4 GiB being the docs' setting), or to glibc's adaptive ceiling when none was asked, so timing runs after it
    keep the allocator they started with."""
    from papo_nb.bench.memory import startup_mmap_threshold

    if asked is None:
        monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    else:
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", asked)
    assert startup_mmap_threshold() == restored
