"""``papo-nb`` console script (run for real, in a subprocess) and ``environment_report``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import papo_nb
from papo_nb import cli
from papo_nb.cli import main
from papo_nb.infra import environment
from papo_nb.infra.environment import NOT_INSTALLED, REPORTED_PACKAGES, environment_report

SCRIPT = Path(sys.executable).parent / ("papo-nb.exe" if os.name == "nt" else "papo-nb")
BASE_KEYS = ["python", *REPORTED_PACKAGES, "cuda_available"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.is_file(), f"console script not installed next to the interpreter: {SCRIPT}"
    return subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


@pytest.fixture(scope="module")
def report() -> dict:
    return environment_report()


# --------------------------------------------------------------------------------------------
# the real console script
# --------------------------------------------------------------------------------------------


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"papo_nb {papo_nb.__version__}"


@pytest.mark.slow  # a subprocess that imports torch
def test_env_prints_name_value_lines(report):
    proc = run_cli("env")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    parsed = dict(line.split(": ", 1) for line in lines)
    assert len(parsed) == len(lines)
    assert list(parsed) == list(report)
    for key in ["python", *REPORTED_PACKAGES]:
        assert parsed[key] == report[key], key
    assert parsed["cuda_available"] == ("true" if report["cuda_available"] else "false")
    if report["cuda_available"]:
        assert parsed["cuda_device"] == report["cuda_device"]


@pytest.mark.slow  # a subprocess that imports torch
def test_env_json_matches_report(report):
    proc = run_cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == report


def test_unknown_subcommand_is_a_usage_error():
    proc = run_cli("no-such-command")
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr


def test_no_subcommand_prints_help_and_fails():
    proc = run_cli()
    assert proc.returncode == 2
    assert "usage: papo-nb" in proc.stderr
    assert "env" in proc.stderr


# --------------------------------------------------------------------------------------------
# in process
# --------------------------------------------------------------------------------------------


def test_report_keys_and_types(report):
    expected = BASE_KEYS + (["cuda_device"] if report["cuda_available"] else [])
    assert list(report) == expected
    assert isinstance(report["cuda_available"], bool)
    for key in ["python", *REPORTED_PACKAGES]:
        assert isinstance(report[key], str) and report[key], key
    json.dumps(report)  # serialisable as is


def test_report_versions_are_the_installed_ones(report):
    assert report["python"] == platform.python_version()
    for name in REPORTED_PACKAGES:
        assert report[name] == metadata.version(name), name


def test_report_cuda_matches_torch(report):
    import torch

    assert report["cuda_available"] is torch.cuda.is_available()
    if torch.cuda.is_available():
        assert report["cuda_device"] == torch.cuda.get_device_name(0)
    else:
        assert "cuda_device" not in report


def test_report_marks_missing_packages(monkeypatch):
    real = metadata.version

    def fake_version(name: str) -> str:
        if name in ("peft", "torch"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(environment.metadata, "version", fake_version)
    report = environment_report()
    assert report["peft"] == NOT_INSTALLED
    assert report["torch"] == NOT_INSTALLED
    assert report["trl"] == real("trl")
    assert report["cuda_available"] is False  # torch not consulted when it is absent
    assert "cuda_device" not in report


def test_main_in_process(capsys, report):
    assert main(["env", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == report
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"papo_nb {papo_nb.__version__}"


def test_subcommands_are_registered_one_function_each():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert len(sub.choices) == len(cli.SUBCOMMANDS)
    assert "env" in sub.choices


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"resume": True, "mlflow_run_id": "abc123"},
        {"resume": True, "force_resume": True},
    ],
    ids=["fresh", "resume-into-run", "force-resume"],
)
def test_a_launched_rank_reads_back_the_run_request(fields, tmp_path, monkeypatch):
    """What ``accelerate launch`` hands every rank parses, with ``papo-nb train``'s own parser, into the request
    that was launched: the same absolute folder, resume flags and MLflow run."""
    from papo_nb.train.distributed import accelerate_command
    from papo_nb.train.request import RunRequest
    from papo_nb.workbook.config.params import WorkbookParams

    monkeypatch.chdir(tmp_path)
    request = RunRequest(WorkbookParams(num_processes=2), "relative/run", **fields)
    assert request.output_dir == tmp_path / "relative" / "run"
    command = accelerate_command(request, tmp_path / "params.yaml", port=29500)
    assert command[command.index("--num_processes") + 1] == "2"
    assert command[command.index("--main_process_port") + 1] == "29500"
    args = cli.build_parser().parse_args(command[command.index("papo_nb.cli") + 1 :])
    assert args.command == "train" and args.params == str(tmp_path / "params.yaml")
    back = RunRequest(request.params, args.output_dir, args.resume, args.force_resume, args.mlflow_run_id)
    assert back == request
