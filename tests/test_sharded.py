"""Sharded training (issue 15): FSDP2 on two CPU processes over gloo, the gamma-zero probe on the shards (and on two
unsharded data-parallel ranks: both tests' numbers, norms and dot products, equal the one-process probe's), a SIGKILLed
sharded run resumed, and the sharded accelerate configs checked against accelerate's own loaders.

What runs where. accelerate 1.15 does not shard on the CPU: ``configs/accelerate/fsdp.yaml`` under ``papo-nb train``
would run as MULTI_CPU (DDP), so papo-nb refuses it (``test_accelerate_fsdp_on_the_cpu_is_refused_not_run_as_ddp``).
The sharded code path is therefore driven directly: ``tests/sharded_worker.py`` under torchrun, the real
PAPOGTrainer's loss, ``fully_shard`` per transformer block (``papo_nb.train.distributed.fully_shard_blocks``),
torch.distributed.checkpoint for the sharded state. Not exercised here: accelerate's FSDP plugin, TRL's generation
under FSDP and ``Trainer.train``'s FSDP checkpoint format (GPU only), and DeepSpeed, not a dependency (run by hand on
the CPU: configs/accelerate/README.md, "Scale-out").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sharded_worker.py"
SMOKE = ROOT / "params" / "smoke_fast.yaml"
CONFIGS = ROOT / "configs" / "accelerate"
STEPS, SAVE_EVERY, KILL_AFTER = 4, 2, 3
NORMS = ("parent_grad_norm", "zero_gamma_grad_norm", "grad_diff_norm", "perception_grad_norm")
TERM_NUMBERS = ("coefficient", "noise_floor", "detectable_coefficient", "injected_leak_coefficient", "grad_norm")
BLOCK_NUMBERS = ("coefficient", "noise_floor", "detectable_coefficient", "injected_leak_over_floor")
STEP_LINE = re.compile(r"sharded step (\d+)/\d+ loss (\S+)")


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    from papo_nb.infra.servers import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port("127.0.0.1")), str(WORKER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def step_losses(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in STEP_LINE.finditer(stdout)}


@pytest.fixture(scope="module")
def setup(tiny_vlm_path, shapes_dataset, tmp_path_factory):
    """One rollout batch and one adapter, saved for the ranks, and the unsharded probe on them in this process."""
    from peft import get_peft_model
    from sharded_worker import build, leaky_assemble, probe_once
    from tiny_trainers import tiny_trainer, unit_params

    from papo_nb.testbed.models import load_vlm
    from papo_nb.workbook.rollouts import rollout_batch
    from papo_nb.workbook.training.builder import lora_config

    folder = tmp_path_factory.mktemp("sharded")
    model, processor = load_vlm(str(tiny_vlm_path))
    torch.manual_seed(0)
    model = get_peft_model(model, lora_config(unit_params()))
    trainer = tiny_trainer(model, processor, shapes_dataset, folder / "rollout")
    batch = rollout_batch(trainer, shapes_dataset, n_prompts=2, seed=0)
    adapter = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    path = folder / "setup.pt"
    torch.save({"model": str(tiny_vlm_path), "batch": batch, "adapter": adapter}, path)
    single = build(torch.load(path, weights_only=False), folder / "single")
    real = probe_once(single, batch)
    single.masks.restart(single.args.mask_seed)
    leaky = probe_once(single, batch, leaky_assemble)
    return dict(folder=folder, path=path, single=real, single_leaky=leaky)


@pytest.fixture(scope="module")
def killed_and_resumed(setup):
    """Two FSDP ranks: the probe (real and leaking) on the setup's batch, then training with a DCP checkpoint every
    SAVE_EVERY steps, rank 0 SIGKILLed after step KILL_AFTER (torchrun then stops the other), then resumed."""
    out = setup["folder"] / "fsdp"
    common = ["--setup", str(setup["path"]), "--out", str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    started = time.monotonic()
    killed = torchrun(*common, "--probe", "--kill-after", str(KILL_AFTER))
    resumed = torchrun(*common, "--resume")
    wall = time.monotonic() - started
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    ranks = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in range(2)]
    return dict(out=out, killed=killed, resumed=resumed, probe_ranks=ranks, wall=wall)


def assert_same_projection(ranked: dict, single: dict) -> None:
    """The projection test's numbers per term equal the one-process probe's: dot products reduced, not rank-local."""
    for name, reference in single["term_leaks"].items():
        mine = ranked["term_leaks"][name]
        assert mine["testable"] == reference["testable"] and mine.get("reason") == reference.get("reason"), name
        if reference["testable"]:
            for key in TERM_NUMBERS:
                assert mine[key] == pytest.approx(reference[key], rel=1e-6, abs=1e-12), (name, key)
            assert mine["leak_seen"] == reference["leak_seen"] and mine["powered"] == reference["powered"], name
    assert ranked["powered"] == single["powered"]
    # the block test (one fit per named parameter group): block sums reduced as the norms are, same Bonferroni count
    assert ranked["tests"] == single["tests"] and ranked["detection_threshold"] == single["detection_threshold"]
    assert ranked["block_leaks"].keys() == single["block_leaks"].keys() and len(single["block_leaks"]) > 1
    for block, terms in single["block_leaks"].items():
        for name, reference in terms.items():
            mine = ranked["block_leaks"][block][name]
            assert mine["testable"] == reference["testable"], (block, name)
            for key in ("share", *(BLOCK_NUMBERS if reference["testable"] else ())):
                assert mine[key] == pytest.approx(reference[key], rel=1e-6, abs=1e-12), (block, name, key)
            assert mine.get("leak_seen") == reference.get("leak_seen"), (block, name)


@pytest.fixture(scope="module")
def ddp(setup):
    """Two unsharded ranks (plain data parallel, gloo): the probe, real and leaking, on the setup's batch."""
    out = setup["folder"] / "ddp"
    result = torchrun("--setup", str(setup["path"]), "--out", str(out), "--probe", "--ddp")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((out / f"probe-rank{r}.json").read_text()) for r in range(2)]


def test_the_ddp_probe_matches_the_one_process_probe_on_the_same_batch(setup, ddp):
    single = setup["single"]
    assert all(r["world"] == 2 and r["sharded_blocks"] == [] for r in ddp)
    for rank in ddp:
        probe, leaky = rank["probe"], rank["leaky_probe"]
        assert probe["status"] == single["status"] == "passed" and probe["loss_bit_equal"]
        for key in NORMS + ("tolerance", "leak_detection_power", "projection_statistic"):
            assert probe[key] == pytest.approx(single[key], rel=1e-6, abs=1e-9), key
        assert_same_projection(probe, single)
        assert leaky["status"] == setup["single_leaky"]["status"] == "failed"
        assert_same_projection(leaky, setup["single_leaky"])
    assert ddp[0]["probe"] == ddp[1]["probe"] and ddp[0]["leaky_probe"] == ddp[1]["leaky_probe"]


def test_the_sharded_probe_matches_the_unsharded_probe_on_the_same_batch(setup, killed_and_resumed):
    single, ranks = setup["single"], killed_and_resumed["probe_ranks"]
    assert all(r["world"] == 2 and r["backend"] == "gloo" for r in ranks)
    assert ranks[0]["sharded_blocks"] == ["Qwen2VLDecoderLayer", "Qwen2VLVisionBlock"]
    rows = [("1 process, unsharded", single)] + [(f"FSDP rank {r['rank']} of 2", r["probe"]) for r in ranks]
    print("\n| probe | " + " | ".join(NORMS) + " | power | verdict |")
    for name, e in rows:
        norms = " | ".join(f"{e[k]:.10e}" for k in NORMS)
        print(f"| {name} | {norms} | {e['leak_detection_power']:.6f} | {e['status']} |")
    assert single["status"] == "passed" and single["leak_detection_power"] >= 1
    for rank in ranks:
        sharded = rank["probe"]
        assert sharded["status"] == single["status"] and sharded["loss_bit_equal"]
        assert sharded["parent_loss"] == pytest.approx(single["parent_loss"], rel=1e-6)
        assert sharded["perception_kl"] == pytest.approx(single["perception_kl"], rel=1e-6)
        for key in NORMS + ("tolerance", "leak_detection_power"):
            assert sharded[key] == pytest.approx(single[key], rel=1e-6, abs=1e-9), key
        assert sharded["perception_grad_norm"] > 0 and sharded["grad_diff_norm"] <= sharded["tolerance"]
        assert_same_projection(sharded, single)
        assert_same_projection(rank["leaky_probe"], setup["single_leaky"])
    # every rank took the same verdict from the same numbers: reduced, not rank-local
    assert ranks[0]["probe"] == ranks[1]["probe"]
    # a gradient being accumulated before the probe is left as it was (the probe runs its own backward passes)
    assert all(r["accumulated_grads_kept"] for r in ranks)


def test_the_sharded_probe_under_fsdp_bf16_mixed_precision(setup):
    """fsdp.yaml's bf16: FSDP2 computes in bf16 and reduces in fp32. Same verdicts; norms near the fp32 ones."""
    out = setup["folder"] / "fsdp_bf16"
    result = torchrun("--setup", str(setup["path"]), "--out", str(out), "--probe", "--bf16")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["probe"] == ranks[1]["probe"] and ranks[0]["leaky_probe"] == ranks[1]["leaky_probe"]
    bf16, single = ranks[0]["probe"], setup["single"]
    print("\nFSDP bf16 mixed precision: " + ", ".join(f"{k} {bf16[k]:.6e}" for k in NORMS), bf16["status"])
    assert bf16["status"] == "passed" and bf16["loss_bit_equal"] and bf16["leak_detection_power"] >= 1
    for key in ("parent_grad_norm", "perception_grad_norm"):
        assert bf16[key] == pytest.approx(single[key], rel=0.05), key  # bf16 roundoff, not a different gradient
    assert ranks[0]["leaky_probe"]["status"] == "failed" and all(r["accumulated_grads_kept"] for r in ranks)


def test_a_leaking_adapter_fails_under_sharding_too(setup, killed_and_resumed):
    assert setup["single_leaky"]["status"] == "failed"
    for rank in killed_and_resumed["probe_ranks"]:
        leaky = rank["leaky_probe"]
        assert leaky["status"] == "failed" and "leaks through the gamma=0 path" in leaky["message"]
        # the leak adds the perception gradient to the difference: seen at its full size on the shards
        assert leaky["grad_diff_norm"] == pytest.approx(setup["single_leaky"]["grad_diff_norm"], rel=1e-6)
        assert leaky["grad_diff_norm"] > leaky["tolerance"]
    assert killed_and_resumed["probe_ranks"][0]["leaky_probe"] == killed_and_resumed["probe_ranks"][1]["leaky_probe"]


def test_a_text_only_rank_next_to_an_image_rank_is_refused_on_every_rank(killed_and_resumed):
    """Only image ranks run the sharded vision tower; its all-gathers would never pair (a 2-rank FSDP job without this
    check aborted in all_gather), so every rank raises the same error instead."""
    errors = [r["mixed_batch_error"] for r in killed_and_resumed["probe_ranks"]]
    assert (
        errors[0]
        == errors[1]
        == (
            "under FSDP every rank's batch must have images or none; 1 of 2 ranks have images in this batch "
            "(mixed text-only data)"
        )
    )


def test_the_probe_runs_inside_a_sharded_training_step(killed_and_resumed):
    out = killed_and_resumed["out"]
    evidence = [json.loads((out / f"train-probe-rank{r}.json").read_text()) for r in range(2)]
    assert evidence[0] == evidence[1] and evidence[0]["status"] == "passed", evidence[0]["message"]


def test_a_killed_sharded_run_resumes_losing_at_most_one_checkpoint_interval(killed_and_resumed):
    k = killed_and_resumed
    killed, resumed = step_losses(k["killed"].stdout), step_losses(k["resumed"].stdout)
    assert k["killed"].returncode != 0 and "SIGKILL" in k["killed"].stdout + k["killed"].stderr
    assert max(killed) == KILL_AFTER, "the first run was not killed mid-way"
    final = [json.loads((k["out"] / f"rank{r}.json").read_text()) for r in range(2)]
    resumed_at = final[0]["resumed_from"]
    assert resumed_at == final[1]["resumed_from"] == KILL_AFTER - KILL_AFTER % SAVE_EVERY
    lost = max(killed) - resumed_at
    assert 0 < lost <= SAVE_EVERY
    assert sorted(resumed) == list(range(resumed_at + 1, STEPS + 1))
    # the sharded weights, AdamW state and masking RNG came back exactly: the re-run step has the same loss
    for step in range(resumed_at + 1, max(killed) + 1):
        assert resumed[step] == killed[step], (step, resumed[step], killed[step])
    assert final[0]["adapter_norm"] == final[1]["adapter_norm"] > 0
    print(
        f"\nFSDP 2 ranks: killed after step {max(killed)}, resumed from step {resumed_at}: {lost} step(s) lost "
        f"(checkpoint every {SAVE_EVERY}); the lost step re-run gives loss {resumed[resumed_at + 1]} both times; "
        f"wall {k['wall']:.0f} s for both launches"
    )


def test_accelerate_fsdp_on_the_cpu_is_refused_not_run_as_ddp(tmp_path):
    """accelerate 1.15 runs fsdp.yaml on the CPU as MULTI_CPU (DDP): without the refusal it trains unsharded."""
    script = Path(sys.executable).parent / "papo-nb"
    command = [str(script), "train", "--params", str(SMOKE), "-p", "num_processes=2", "-p", "max_steps=1"]
    command += ["-p", f"accelerate_config={CONFIGS / 'fsdp.yaml'}", "--output-dir", str(tmp_path / "run")]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "the accelerate config asks for FSDP but accelerate runs this job as MULTI_CPU (device cpu)" in output
    assert not (tmp_path / "run" / "train_summary.json").exists()


@pytest.mark.parametrize("name", ["fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_sharded_accelerate_configs_pass_accelerates_own_loaders(name, monkeypatch):
    """What ``accelerate launch`` does with the file up to the training script: the config schema
    (``load_config_from_file``), the launcher's validation, and the plugin built from it (FSDP: from the
    environment the launcher sets; DeepSpeed: from the ``deepspeed_config`` block, without DeepSpeed installed)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = CONFIGS / name
    config = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    assert config.mixed_precision == "bf16" and config.num_processes == 2
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    if name == "fsdp.yaml":
        assert config.distributed_type.value == "FSDP" and args.use_fsdp
        env = prepare_multi_gpu_env(args)
        for key, value in env.items():
            if key.startswith("FSDP_"):
                monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        assert plugin.state_dict_type.name == "SHARDED_STATE_DICT" and plugin.cpu_ram_efficient_loading
        assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    else:
        stage = int(name[-6])
        assert config.distributed_type.value == "DEEPSPEED" and args.use_deepspeed and args.zero_stage == stage
        plugin = DeepSpeedPlugin(**raw["deepspeed_config"])  # an unknown key is a TypeError
        zero = plugin.deepspeed_config["zero_optimization"]
        assert zero["stage"] == stage and zero["offload_param"]["device"] == "none"
        assert zero["stage3_gather_16bit_weights_on_model_save"] == (stage == 3)
