"""``papo-nb train``: two gloo processes, a SIGKILLed run resumed, corrupt checkpoints, refused resumes, and the
reference policy of a phase-2 run. Real subprocesses, the tiny model, an SQLite MLflow store in tmp_path."""

from __future__ import annotations

import json
import re
import shutil
import signal
import sqlite3
import subprocess
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from training_child import SCRIPT, SMOKE, Train, child_env, only_run

from papo_nb.cli import main
from papo_nb.infra.tracking import ARTIFACTS_DIRNAME, DB_FILENAME, artifacts_dir, sqlite_path
from papo_nb.train.integrity import CorruptCheckpointWarning, checkpoint_problems, find_resume_checkpoint
from papo_nb.train.output import LOG_FILE
from papo_nb.train.resume import ResumeMismatch
from papo_nb.train.run_folder import (
    PARAMS_FILE,
    PROGRESS_PREFIX,
    RESUME_EVIDENCE_FILE,
    SUMMARY_FILE,
    read_run_info,
)
from papo_nb.train.runner import run_training
from papo_nb.workbook.config.params import load_params
from papo_nb.workbook.results.page import NOTE_TAG
from papo_nb.workbook.training.checkpoints import checkpoint_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS, SAVE_STEPS = 6, 2
# A larger lr than the smoke run's, so that the trained adapter is far from the base model (phase-2 test).
RUN = ["-p", f"max_steps={MAX_STEPS}", "-p", f"save_steps={SAVE_STEPS}", "-p", "learning_rate=0.005"]
STEP_LINE = re.compile(rf"{PROGRESS_PREFIX} step (\d+)/")


# --------------------------------------------------------------------------------------------
# two processes (gloo)
# --------------------------------------------------------------------------------------------


def test_two_gloo_processes_train_with_the_probe_and_log_one_set_of_metrics(tmp_path, capsys):
    uri, out, steps = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "run", 3
    started = time.monotonic()
    result = subprocess.run(
        [
            str(SCRIPT),
            "train",
            "--params",
            str(SMOKE),
            "-p",
            "num_processes=2",
            "-p",
            f"max_steps={steps}",
            "-p",
            "save_steps=3",
            "-p",
            "require_gpu_contract_probe=true",
            "--output-dir",
            str(out),
        ],
        env=child_env(uri),
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - started
    with capsys.disabled():
        print(f"\n2-process gloo run: {steps} PAPO-G steps, wall time {wall:.1f} s")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "accelerate.commands.launch" in result.stdout and "cpu_gloo.yaml" in result.stdout

    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["num_processes"] == 2 and summary["global_step"] == steps
    assert summary["probe"]["status"] == "passed" and summary["probe"]["perception_kl"] > 0
    # every rank logged the same perception KL, entropies, rewards and probe numbers: reduced, not rank-local
    assert summary["probe_same_on_all_ranks"] and summary["metrics_same_on_all_ranks"]

    client = MlflowClient(uri)
    run = only_run(client)  # rank 1 made no run of its own
    assert run.info.status == "FINISHED" and run.data.tags["papo_nb.num_processes"] == "2"
    for key in ("reward", "loss", "perception_kl", "masked_entropy", "entropy", "perception_loss"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(1, steps + 1)), (
            key
        )
    assert len(client.get_metric_history(run.info.run_id, "probe/passed")) == 1
    metrics = run.data.metrics
    assert metrics["probe_final/passed"] == 1.0 and metrics["probe_final/same_on_all_ranks"] == 1.0
    assert metrics["start/num_processes"] == 2
    # the launching process's train.log has every line once (the job's rank 0 writes none of its own), and its run
    # ends on the held-out evaluation and the results page, as a one-process run does
    log = (out / LOG_FILE).read_text()
    assert log.count(f"{PROGRESS_PREFIX} step {steps}/{steps}") == 1 and "accelerate.commands.launch" in log
    assert "eval/accuracy_original" in metrics and NOTE_TAG in run.data.tags


# --------------------------------------------------------------------------------------------
# killed and resumed
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """A run SIGKILLed as soon as it has a complete checkpoint, then resumed with --resume to the end."""
    folder = tmp_path_factory.mktemp("killed")
    uri, out = f"sqlite:///{folder}/mlflow.db", folder / "run"
    command = [str(SCRIPT), "train", "--params", str(SMOKE), *RUN, "--output-dir", str(out)]
    train = Train(command, uri)

    def killable() -> bool:  # mid-way: a complete checkpoint, and a step done since it
        checkpoint = find_resume_checkpoint(out, warn=False)[0]
        return checkpoint is not None and train.last_step() > checkpoint_step(checkpoint)

    train.wait_until(killable, "checkpoint with a step done since it")
    train.process.send_signal(signal.SIGKILL)
    assert train.finish() == -signal.SIGKILL
    steps_done = train.last_step()
    checkpoint_at_kill, _ = find_resume_checkpoint(out, warn=False)
    info_before = read_run_info(out)

    resumed = subprocess.run(command + ["--resume"], env=child_env(uri), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    return dict(
        uri=uri,
        out=out,
        command=command,
        steps_done=steps_done,
        checkpoint_at_kill=checkpoint_at_kill,
        info_before=info_before,
        resumed=resumed,
    )


def test_a_killed_run_resumes_where_its_checkpoint_left_off(killed_and_resumed):
    k = killed_and_resumed
    out, checkpoint = k["out"], k["checkpoint_at_kill"]
    assert k["steps_done"] < MAX_STEPS, "the run was not killed mid-way"
    evidence = json.loads((out / RESUME_EVIDENCE_FILE).read_text())
    resumed_at = evidence["resumed_at_step"]
    # the right step, with the checkpoint's optimizer, scheduler, adapter and masking RNG, exactly
    assert evidence["checkpoint"] == str(checkpoint) and resumed_at == evidence["checkpoint_step"] == checkpoint_step(
        checkpoint
    )
    assert evidence["restored"] and evidence["mask_rng_restored"]
    assert evidence["adapter_max_abs_difference"] == 0.0
    assert evidence["optimizer_max_abs_difference"] == 0.0 and evidence["optimizer_steps"] == resumed_at
    assert evidence["scheduler_max_abs_difference"] == 0.0 and evidence["scheduler_last_epoch"] == resumed_at
    lost = k["steps_done"] - resumed_at
    assert 0 <= lost <= SAVE_STEPS
    first_new_step = min(int(m.group(1)) for m in map(STEP_LINE.search, k["resumed"].stdout.splitlines()) if m)
    assert first_new_step == resumed_at + 1
    print(
        f"\nkilled after step {k['steps_done']}, resumed from step {resumed_at}: {lost} step(s) lost "
        f"(save_steps {SAVE_STEPS})"
    )

    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["global_step"] == MAX_STEPS and summary["probe"]["status"] == "passed"
    info = read_run_info(out)
    assert info["mlflow_run_id"] == k["info_before"]["mlflow_run_id"] == summary["mlflow_run_id"]
    assert [a["resumed_from"] for a in info["attempts"]] == [None, str(checkpoint)]

    client = MlflowClient(k["uri"])
    run = only_run(client)  # the same MLflow run, re-attached
    assert run.info.run_id == info["mlflow_run_id"] and run.info.status == "FINISHED"
    steps = {m.step for m in client.get_metric_history(run.info.run_id, "reward")}
    assert set(range(resumed_at + 1, MAX_STEPS + 1)) <= steps <= set(range(1, MAX_STEPS + 1))
    assert run.data.metrics["resume/restored"] == 1.0 and run.data.tags["papo_nb.attempts"] == "2"


def copy_run(k, tmp_path) -> tuple[Path, str]:
    """A copy of the killed-and-resumed run folder and of its MLflow store, as (folder, tracking uri): a test that
    trains the copy re-attaches to the same MLflow run id, and must do it in its own store, not in the fixture's
    (there it would add an attempt that test_a_killed_run_resumes_where_its_checkpoint_left_off would then count)."""
    copy = tmp_path / "run"
    shutil.copytree(k["out"], copy)
    db, store = sqlite_path(k["uri"]), tmp_path / "store"
    store.mkdir()
    shutil.copy2(db, store / DB_FILENAME)
    shutil.copytree(artifacts_dir(k["uri"]), store / ARTIFACTS_DIRNAME)
    uri = f"sqlite:///{store / DB_FILENAME}"
    relocate_artifacts(store / DB_FILENAME, artifacts_dir(k["uri"]).as_uri(), artifacts_dir(uri).as_uri())
    return copy, uri


# where an MLflow 3 SQLite store keeps absolute artifact locations
ARTIFACT_COLUMNS = [
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("logged_models", "artifact_location"),
]


def relocate_artifacts(db: Path, old: str, new: str) -> None:
    """Point a copied store's artifact locations at its own copy of ``mlartifacts/`` (MLflow stores them absolute)."""
    with closing(sqlite3.connect(db)) as connection, connection:
        for table, column in ARTIFACT_COLUMNS:
            connection.execute(f"UPDATE {table} SET {column} = replace({column}, ?, ?)", (old, new))


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("truncate_adapter", "adapter_model.safetensors has .* bytes where its header describes"),
        ("drop_trainer_state", "missing trainer_state.json"),
        ("drop_optimizer", "missing optimizer.pt"),
        ("truncate_optimizer", "optimizer.pt is not a complete torch archive"),
    ],
)
def test_a_corrupt_last_checkpoint_is_skipped_with_a_warning_naming_it(killed_and_resumed, tmp_path, damage, expected):
    out, _ = copy_run(killed_and_resumed, tmp_path)
    last = out / f"checkpoint-{MAX_STEPS}"
    target = {
        "truncate_adapter": "adapter_model.safetensors",
        "drop_trainer_state": "trainer_state.json",
        "drop_optimizer": "optimizer.pt",
        "truncate_optimizer": "optimizer.pt",
    }[damage]
    if damage.startswith("truncate"):
        data = (last / target).read_bytes()
        (last / target).write_bytes(data[: len(data) // 2])
    else:
        (last / target).unlink()
    with pytest.warns(
        CorruptCheckpointWarning,
        match=rf"skipping corrupt or partial checkpoint {re.escape(str(last))}: .*{expected}",
    ):
        checkpoint, skipped = find_resume_checkpoint(out)
    assert checkpoint == out / f"checkpoint-{MAX_STEPS - SAVE_STEPS}" and [s[0] for s in skipped] == [last]


def test_resume_past_a_truncated_checkpoint_trains_from_the_previous_one(killed_and_resumed, tmp_path):
    k = killed_and_resumed
    out, uri = copy_run(k, tmp_path)
    adapter = out / f"checkpoint-{MAX_STEPS}" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    result = subprocess.run(
        k["command"][:-1] + [str(out), "--resume"], env=child_env(uri), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (
        "CorruptCheckpointWarning" in result.stderr
        and f"checkpoint {out / f'checkpoint-{MAX_STEPS}'}" in result.stderr
    )
    evidence = json.loads((out / RESUME_EVIDENCE_FILE).read_text())
    assert evidence["resumed_at_step"] == MAX_STEPS - SAVE_STEPS and evidence["restored"]
    assert checkpoint_problems(out / f"checkpoint-{MAX_STEPS}") == []  # saved again, complete
    assert len(list(out.glob(f"corrupt-checkpoint-{MAX_STEPS}-*"))) == 1  # the damaged one set aside


# --------------------------------------------------------------------------------------------
# refused runs
# --------------------------------------------------------------------------------------------


def test_resume_with_different_parameters_is_refused_naming_them(killed_and_resumed, tmp_path, capsys):
    out, _ = copy_run(killed_and_resumed, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code = main(
        [
            "train",
            "--params",
            str(SMOKE),
            *RUN,
            "-p",
            "lora_r=16",
            "-p",
            "mask_ratio=0.5",
            "-p",
            "perception_loss_schedule=linear",
            "-p",
            "save_steps=3",
            "--output-dir",
            str(out),
            "--resume",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"refusing to resume the run in {out}" in err and "3 parameter(s) differ" in err
    assert "lora_r: 8 (original) -> 16 (now)" in err and "mask_ratio: 0.6 (original) -> 0.5 (now)" in err
    assert "perception_loss_schedule: 'fixed' (original) -> 'linear' (now)" in err and "--force-resume" in err
    assert "save_steps" not in err  # how often a run saves does not change what it trains
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before, "a refused resume must write nothing"

    code = main(["train", "--params", str(SMOKE), *RUN, "--output-dir", str(out)])  # no --resume: refused too
    err = capsys.readouterr().err
    assert code == 2 and f"{out} already holds a run" in err and "pass --resume to continue it" in err


def test_force_resume_accepts_and_records_the_changes(killed_and_resumed, tmp_path):
    k = killed_and_resumed
    out, uri = copy_run(k, tmp_path)
    shutil.rmtree(out / f"checkpoint-{MAX_STEPS}")  # so that steps remain to be trained
    params = load_params(SMOKE, [o for o in RUN if o != "-p"] + ["mask_ratio=0.5"])
    with pytest.raises(ResumeMismatch, match=r"mask_ratio: 0.6 \(original\) -> 0.5 \(now\)"):
        run_training(params, out, resume=True, tracking_uri=uri)
    outcome = run_training(params, out, force_resume=True, tracking_uri=uri)
    assert outcome.resumed_from == out / f"checkpoint-{MAX_STEPS - SAVE_STEPS}" and outcome.global_step == MAX_STEPS
    assert outcome.mlflow_run_id == k["info_before"]["mlflow_run_id"]
    assert read_run_info(out)["attempts"][-1]["forced_parameter_changes"] == {"mask_ratio": [0.6, 0.5]}
    assert yaml.safe_load((out / PARAMS_FILE).read_text())["mask_ratio"] == 0.5

    # a complete run resumed stays complete (the Trainer alone would run one step past max_steps)
    again = run_training(params, out, resume=True, tracking_uri=uri)
    assert again.global_step == MAX_STEPS and again.trainer is None


# --------------------------------------------------------------------------------------------
# phase 2: a new run from a trained adapter
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reference", ["init_adapter", "base"])
def test_phase2_restores_the_trained_adapter_trainable_with_the_chosen_reference(
    killed_and_resumed, shapes_dataset, tmp_path, reference
):
    from safetensors.torch import load_file

    from papo_nb.workbook.rollouts import rollout_batch
    from papo_nb.workbook.training.builder import prepare_training
    from papo_nb.workbook.training.checkpoints import (
        REFERENCE_MATCH_TOL,
        adapter_tensors,
        describe_reference,
        reference_evidence,
    )

    trained = killed_and_resumed["out"] / f"checkpoint-{MAX_STEPS}"
    params = load_params(SMOKE, [f"init_adapter={trained}", f"reference_policy={reference}", "beta=0.01"])
    trainer, _, restored = prepare_training(params, tmp_path / "phase2")

    # the restored policy is the trained one, tensor for tensor, and it is the one that trains
    saved, loaded = load_file(str(trained / "adapter_model.safetensors")), adapter_tensors(trainer.model)
    assert restored.equal and set(saved) == set(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".default." in n for n in trainable) and restored.trainable_parameters > 0
    has_ref_adapter = "ref" in trainer.model.peft_config
    assert has_ref_adapter == (reference == "init_adapter")
    if has_ref_adapter:
        assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if ".ref." in n)

    # TRL's own reference log-probs, before any step, against the base model's and the loaded adapter's
    batch = rollout_batch(trainer, shapes_dataset, n_prompts=1, seed=0)
    evidence = reference_evidence(trainer, batch)
    assert evidence["start_policy_vs_base"] > 100 * REFERENCE_MATCH_TOL, (
        "the trained adapter should differ from the base model"
    )
    assert evidence["matches"] == reference, evidence
    print(f"\nreference_policy={reference}: {evidence}")
    assert ("frozen copy of the loaded adapter" in describe_reference(trainer)) == (reference == "init_adapter")
    assert ("base model" in describe_reference(trainer)) == (reference == "base")

    # and one backward moves the trainable adapter only
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None for n, p in trainer.model.named_parameters() if ".ref." in n)


def test_accelerate_configs_load_and_are_documented():
    from accelerate.commands.config.config_args import load_config_from_file

    folder = ROOT / "configs" / "accelerate"
    readme = (folder / "README.md").read_text()
    expected = {
        "multi_gpu.yaml": "MULTI_GPU",
        "deepspeed_zero2.yaml": "DEEPSPEED",
        "deepspeed_zero3.yaml": "DEEPSPEED",
        "fsdp.yaml": "FSDP",
        "cpu_gloo.yaml": "MULTI_GPU",
    }
    for name, kind in expected.items():
        assert load_config_from_file(str(folder / name)).distributed_type.value == kind, name
        assert name in readme, name
    assert "use_vllm" in readme and "colocate" in readme and "server" in readme
