"""CPU kernel paths: every path this CPU runs trains attention in bf16 once papo_nb is imported, and a path it cannot
run is refused by name before any work (papo_nb/testbed/kernel_paths.py).

The child processes matter: ATen reads ``ATEN_CPU_CAPABILITY`` once, when torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from papo_nb.testbed import kernel_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_AMX = torch.cpu._is_amx_tile_supported()
RUNNABLE = kernel_paths.cpu_paths()
EMULATED = RUNNABLE[:-1]

# bf16 causal attention forward and backward, and fp32 inputs under bf16 autocast (the two forms that broke on AMX),
# each against an fp64 reference; prints the SDPA backend torch chose.
ATTENTION = """
import sys, torch
if sys.argv[1] == "papo_nb":
    import papo_nb  # noqa: F401  (applies the project's choice for the requested kernel path)
torch.manual_seed(0)
q = torch.randn(2, 4, 96, 32, requires_grad=True)
reference = torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True)
out = torch.nn.functional.scaled_dot_product_attention(*(q.bfloat16(),) * 3, is_causal=True)
out.float().sum().backward()
with torch.autocast("cpu", dtype=torch.bfloat16):
    cast = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
error = max((out.double() - reference).abs().max().item(), (cast.double() - reference).abs().max().item())
assert error < 0.05 and q.grad.isfinite().all(), error
print("backend", torch._fused_sdp_choice(q.bfloat16(), q.bfloat16(), q.bfloat16(), is_causal=True), "error", error)
"""


def _child(code: str, *args: str, path: str | None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != kernel_paths.VARIABLE}
    if path is not None:
        env[kernel_paths.VARIABLE] = path
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_paths_this_cpu_runs_end_at_the_one_torch_picks_natively():
    native = _child("import torch; print(torch.backends.cpu.get_cpu_capability())", path=None)
    assert RUNNABLE[0] == "default" and list(kernel_paths.PATHS[: len(RUNNABLE)]) == RUNNABLE
    assert native.stdout.strip().lower() == RUNNABLE[-1] or RUNNABLE == ["default"]  # non-x86: default only


@pytest.mark.parametrize(
    ("path", "runnable", "has_amx", "backend"),
    [
        ("avx2", ["default", "avx2", "avx512"], True, "math"),  # the Sapphire Rapids case
        ("default", ["default", "avx2", "avx512"], True, "math"),
        ("avx512", ["default", "avx2", "avx512"], True, "flash"),  # native: its own kernel
        ("avx2", ["default", "avx2", "avx512"], False, "flash"),  # AVX-512 without AMX: flash packs nothing
        ("default", ["default", "avx2"], False, "flash"),
    ],
)
def test_attention_leaves_flash_only_where_an_emulated_path_meets_amx(path, runnable, has_amx, backend):
    assert kernel_paths.attention_backend(path, runnable, has_amx) == backend


@pytest.mark.parametrize(
    ("requested", "runnable", "says"),
    [
        ("avx", ["default", "avx2"], "is not a kernel path: allowed ['default', 'avx2', 'avx512']"),
        ("AVX-512", ["default", "avx2"], "is not a kernel path"),
        ("avx512", ["default", "avx2"], "asks for instructions this CPU (cpu X) lacks: it runs ['default', 'avx2']"),
        ("avx2", ["default"], "SIGILL"),
    ],
)
def test_a_path_this_cpu_cannot_run_is_refused_by_name(requested, runnable, says):
    with pytest.raises(kernel_paths.KernelPathError, match="ATEN_CPU_CAPABILITY") as refused:
        kernel_paths.check_path(requested, runnable, "cpu X")
    assert says in str(refused.value) and repr(requested) in str(refused.value)
    assert kernel_paths.check_path(" AVX2 ", ["default", "avx2"], "cpu X") == "avx2"


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNNABLE)
def test_bf16_attention_runs_on_every_path_this_cpu_runs_once_papo_nb_is_imported(path):
    done = _child(ATTENTION, "papo_nb", path=path)
    assert done.returncode == 0, done.stderr[-2000:]
    math = kernel_paths.attention_backend(path, RUNNABLE, HAS_AMX) == "math"
    assert done.stdout.split()[1] == ("0" if math else "1")  # torch's SDPBackend: 0 math, 1 flash
    assert ("SDPA's math backend" in done.stderr) == math


@pytest.mark.slow
@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX: its flash attention kernel runs on every emulated path")
@pytest.mark.parametrize("path", EMULATED)
def test_without_papo_nb_bf16_attention_fails_on_an_emulated_path_of_an_amx_cpu(path):
    """The failure the project's choice removes, reproduced: torch alone, emulated path, AMX CPU."""
    done = _child(ATTENTION, "torch-alone", path=path)
    assert done.returncode != 0 and "pack_vnni2 is only supported when avx512 is supported" in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["-m", "papo_nb.cli", "env"],
        ["-m", "papo_nb.testbed.across_paths", "--help"],
        ["-m", "papo_nb.infra.smoke_paths", "--help"],
    ],
)
def test_every_entry_point_refuses_an_unknown_path_before_any_work(command):
    done = subprocess.run(
        [sys.executable, *command],
        env={**os.environ, kernel_paths.VARIABLE: "avx"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "ATEN_CPU_CAPABILITY='avx' is not a kernel path: allowed ['default', 'avx2', 'avx512']" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif("avx512" in RUNNABLE, reason="this CPU runs avx512, the highest path: none above it to refuse")
def test_a_path_above_this_cpu_is_refused_instead_of_dying_with_sigill():
    above = kernel_paths.PATHS[len(RUNNABLE)]
    refused = _child(ATTENTION, "papo_nb", path=above)
    assert refused.returncode not in (0, -4, 132) and "lacks" in refused.stderr and above in refused.stderr
    crashed = _child(ATTENTION, "torch-alone", path=above)  # what torch alone does with the same request
    assert crashed.returncode in (-4, 132), crashed.stderr[-500:]  # SIGILL
