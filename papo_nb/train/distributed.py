"""Several training processes: ranks, the ``accelerate launch`` command that starts them, and cross-rank checks.

``num_processes > 1``: ``papo-nb train`` runs itself again under ``accelerate launch`` (``launch_distributed``),
one process per device; every rank trains, only rank 0 writes files and MLflow (TRL's MLflow callback logs on
the world's main process only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from papo_nb.infra.servers import free_port, stop_process_group
from papo_nb.train.output import LAUNCHER_KEEPS_LOG_ENV, start_run_log
from papo_nb.train.request import RunRequest
from papo_nb.train.run_folder import PROGRESS_PREFIX, SUMMARY_FILE, LaunchError, LaunchFailed
from papo_nb.workbook.config.params import WorkbookParams

CONFIG_DIR = Path("configs") / "accelerate"
DEFAULT_GPU_CONFIG = "multi_gpu.yaml"
DEFAULT_CPU_CONFIG = "cpu_gloo.yaml"


# ranks are read from the launcher's environment: usable before torch.distributed is initialised


def process_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def under_launcher() -> bool:
    """Started by ``accelerate launch`` / torchrun (one of several processes, or a launcher of one)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def refuse_wrong_world_size(params: WorkbookParams) -> None:
    """Refuse a job whose process count is not ``num_processes`` (every rank checks alike, before training)."""
    if world_size() != params.num_processes:
        raise LaunchError(
            f"parameter 'num_processes' = {params.num_processes} but this job has {world_size()} process(es); "
            "run papo-nb train with -p num_processes=N (it starts accelerate launch itself), or launch "
            "exactly num_processes processes"
        )


def refuse_unsupported(trainer) -> None:
    """Refuse a sharded accelerate config that accelerate did not apply, and the probe under DeepSpeed.

    accelerate 1.15 on the CPU picks MULTI_CPU (DDP over gloo) and never looks at an FSDP config
    (``AcceleratorState.__init__``: the FSDP switch is only under the GPU-like types), so ``fsdp.yaml`` there would
    train unsharded without a word. (DeepSpeed, when installed, does run on the CPU; the check covers it alike.)
    Under FSDP2 the probe reads the gradient shards (``papo/probe/reduce.py``); under ZeRO-3 the parameters are
    partitioned in a way it does not read, and under ZeRO-2 DeepSpeed's own gradient reduction broke after it."""
    wanted = [
        name
        for name, variable in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"))
        if os.environ.get(variable, "false").lower() == "true"
    ]
    actual = trainer.accelerator.distributed_type.value
    if wanted and actual not in wanted:
        raise LaunchError(
            f"the accelerate config asks for {wanted[0]} but accelerate runs this job as {actual} "
            f"(device {trainer.accelerator.device.type}), so nothing would be sharded (accelerate 1.15 applies FSDP "
            "to GPU processes only). On the CPU use configs/accelerate/cpu_gloo.yaml (DDP); FSDP on the CPU is "
            "tested with torch's fully_shard directly (tests/test_sharded.py)"
        )
    deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if trainer.probe is not None and deepspeed is not None:
        # ZeRO-3 partitions the parameters; under ZeRO-2 (measured on CPU, DeepSpeed 0.19.8) its gradient reduction
        # then failed with an IndexError in reduce_ipg_grads; ZeRO-1 was not tried.
        raise LaunchError(
            f"require_gpu_contract_probe is not supported under DeepSpeed (ZeRO-{deepspeed.zero_stage}: ZeRO-3 "
            "partitions the parameters, and ZeRO-2's gradient reduction failed after the probe); set it false for "
            "this run and run the probe in a DDP or FSDP job (configs/accelerate/multi_gpu.yaml, fsdp.yaml)"
        )


def fully_shard_blocks(model, **options) -> list[str]:
    """FSDP2 by hand: ``fully_shard`` on every transformer block (the classes in ``_no_split_modules``, what
    accelerate's TRANSFORMER_BASED_WRAP picks), then on the root. Returns the block classes sharded.

    accelerate 1.15 does not use its FSDP plugin on the CPU (``AcceleratorState`` picks MULTI_CPU, i.e. DDP, before
    it looks at the plugin), so the CPU tests shard with this under torchrun/gloo; on GPU, ``fsdp.yaml`` does it.
    ``options`` go to every ``fully_shard`` call (e.g. ``mp_policy``)."""
    from torch.distributed.fsdp import fully_shard

    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"no transformer block to shard in {type(model).__name__}: _no_split_modules is empty")
    classes = sorted({type(b).__name__ for b in blocks})  # before fully_shard renames them FSDP<class>
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return classes


# Logged metrics that must be identical on every rank: reduced (or gathered) across processes before logging.
RANK_INVARIANT_METRICS = (
    "reward",
    "reward_std",
    "entropy",
    "kl",
    "perception_kl",
    "perception_loss",
    "masked_entropy",
)


def same_on_all_ranks(trainer, probe: dict | None) -> tuple[bool, bool]:
    """Whether every rank holds the same probe evidence, and the same per-step values of the metrics that are
    reduced across processes (a rank-local value would differ: each rank sees other prompts). One process: True."""
    if trainer.accelerator.num_processes == 1:
        return True, True
    from accelerate.utils import gather_object

    metrics = [
        {k: h[k] for k in sorted(h) if k in RANK_INVARIANT_METRICS or k.startswith("probe/")}
        for h in trainer.state.log_history
    ]
    probes, histories = zip(*gather_object([(json.dumps(probe, sort_keys=True), json.dumps(metrics, sort_keys=True))]))
    return len(set(probes)) == 1, len(set(histories)) == 1


def accelerate_config_path(params: WorkbookParams) -> Path:
    """``accelerate_config`` (relative to the cwd or the project folder), else the DDP default for the device."""
    from papo_nb.infra.tracking import project_dir
    from papo_nb.workbook.config.paths import resolve_device

    name = params.accelerate_config or str(
        CONFIG_DIR / (DEFAULT_GPU_CONFIG if resolve_device(params) == "cuda" else DEFAULT_CPU_CONFIG)
    )
    path = Path(name).expanduser()
    for candidate in (path, project_dir() / path):
        if candidate.is_file():
            return candidate.resolve()
    raise LaunchError(
        f"accelerate config {name!r} not found (looked in {Path.cwd()} and {project_dir()}); "
        f"set parameter 'accelerate_config' to one of {project_dir() / CONFIG_DIR}/*.yaml or your own"
    )


def accelerate_command(request: RunRequest, params_file: str | Path, *, port: int | None = None) -> list[str]:
    """``python -m accelerate.commands.launch --config_file C --num_processes N -m papo_nb.cli train ...``."""
    params = request.params
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(accelerate_config_path(params)),
        "--num_processes",
        str(params.num_processes),
        "--main_process_port",
        str(port or free_port("127.0.0.1")),
        "-m",
        "papo_nb.cli",
        "train",
        *request.train_arguments(params_file),
    ]


@dataclass
class LaunchResult:
    """What ``launch_distributed`` ran and where its results are."""

    returncode: int
    command: list[str]
    output_dir: Path
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def summary(self) -> dict:
        path = self.output_dir / SUMMARY_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the launched run did not finish (exit code {self.returncode})"
            )
        return json.loads(path.read_text())

    def check(self) -> LaunchResult:
        if not self.ok:
            raise LaunchFailed(self.returncode, self.command)
        return self


def launch_distributed(request: RunRequest, *, stream: TextIO | None = None) -> LaunchResult:
    """Run ``papo-nb train`` for ``request`` on ``params.num_processes`` processes under ``accelerate launch``,
    streaming its output (to ``stream``, default stdout) line by line. Interrupting this call stops the whole
    launched job."""
    from papo_nb.infra.tracking import absolute_tracking_uri, default_tracking_uri

    stream, params = stream or sys.stdout, request.params
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="papo_nb-launch-") as folder:
        params_file = Path(folder) / "params.yaml"
        params_file.write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
        command = accelerate_command(request, params_file)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "MLFLOW_TRACKING_URI": absolute_tracking_uri(request.tracking_uri or default_tracking_uri()),
            LAUNCHER_KEEPS_LOG_ENV: "1",  # this process's train.log gets every rank's lines (stream below)
        }
        start_run_log()  # the launching process's log gets every rank's lines from here on
        stream.write(f"{PROGRESS_PREFIX} launching {params.num_processes} processes: {' '.join(command)}\n")
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        try:
            for line in process.stdout:
                stream.write(line)
                stream.flush()
            returncode = process.wait()
        except BaseException:
            stop_process_group(process)
            raise
    return LaunchResult(returncode, command, request.output_dir, time.monotonic() - started)
