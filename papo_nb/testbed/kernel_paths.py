"""CPU kernel paths (``ATEN_CPU_CAPABILITY``): which ones this CPU runs, and what papo_nb does when one is requested.

ATen compiles its CPU kernels once per instruction set and picks one when torch loads; ``ATEN_CPU_CAPABILITY``
asks for another (``default``, ``avx2``, ``avx512`` on x86), which reproduces another machine's roundoff on this one.
The request is not checked by torch, and two cases trip it:

- a path above the CPU's own (``avx512`` on an AVX2-only CPU) is taken as given, and the first kernel that uses the
  missing instructions kills the process with SIGILL (exit 132), mid-run, with no message;
- an unknown name (``avx``, ``AVX-512``) is silently ignored, so the run is on the native path while the user believes
  it is emulated.

A third is a limit of the emulation itself: on a CPU with AMX (Intel Sapphire Rapids and later), torch's flash
attention kernel for bf16 packs its operands for AMX, and the ``default``/``avx2`` builds of that kernel cannot pack
(``RuntimeError: pack_vnni2 is only supported when avx512 is supported``). There papo_nb runs scaled-dot-product
attention on SDPA's math backend, which every build runs, and says so once: attention's roundoff is then the math
kernel's, not that of a real AVX2 machine's flash kernel, and the rest of ATen is emulated as asked.

``honour_requested_path`` applies all of this; ``papo_nb/__init__.py`` calls it when the variable is set, so every
process that imports papo_nb (the CLI, notebook kernels, training workers, testbed builds) is covered before any
expensive work.

    python -m papo_nb.testbed.kernel_paths [PATH ...]   # what each path does on this CPU (CI prints it)
"""

from __future__ import annotations

import os
import platform
import sys

PATHS = ("default", "avx2", "avx512")
VARIABLE = "ATEN_CPU_CAPABILITY"


class KernelPathError(RuntimeError):
    """An ``ATEN_CPU_CAPABILITY`` this CPU cannot run, or that torch would silently ignore."""


def cpu_description() -> str:
    """The CPU in words, for messages: its model name and the instruction sets that decide the kernel paths."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:  # not Linux
        pass
    features = [name for name, has in _x86_features(torch).items() if has]
    return f"{model} ({', '.join(features) or 'no AVX2'})"


def _x86_features(torch) -> dict[str, bool]:
    # torch reads these from cpuinfo, whatever ATEN_CPU_CAPABILITY says (the same source ATen's dispatch uses)
    return {
        "AVX2": torch.cpu._is_avx2_supported(),
        "AVX-512": torch.cpu._is_avx512_supported(),
        "AMX": torch.cpu._is_amx_tile_supported(),
    }


def cpu_paths() -> list[str]:
    """The kernel paths this CPU can run: ``default`` always, then ``avx2`` and ``avx512`` where it has them."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["default"]  # e.g. ARM: its own paths are not emulated here
    features = _x86_features(torch)
    return ["default"] + (["avx2"] if features["AVX2"] else []) + (["avx512"] if features["AVX-512"] else [])


def attention_backend(path: str, runnable: list[str], has_amx: bool) -> str:
    """``"flash"`` (torch's choice) or ``"math"``: the SDPA backend papo_nb uses on kernel ``path``. The math backend
    only where the CPU's flash kernel cannot run: an emulated path below the native one on a CPU with AMX."""
    emulated = path != runnable[-1]
    return "math" if emulated and has_amx else "flash"


def check_path(requested: str, runnable: list[str], cpu: str) -> str:
    """The kernel path ``requested`` names (lower case), or a ``KernelPathError`` naming the setting and the CPU."""
    path = requested.strip().lower()
    if path not in PATHS:
        raise KernelPathError(
            f"{VARIABLE}={requested!r} is not a kernel path: allowed {list(PATHS)}, and this CPU ({cpu}) runs "
            f"{runnable}. torch would ignore it and run natively; unset it or name one of those."
        )
    if path not in runnable:
        raise KernelPathError(
            f"{VARIABLE}={requested!r} asks for instructions this CPU ({cpu}) lacks: it runs {runnable}. "
            "torch would take the request and die with SIGILL (exit 132) at the first such kernel; "
            f"use one of {runnable} or unset it."
        )
    return path


def honour_requested_path(environ: dict[str, str] | None = None) -> str | None:
    """Validate ``ATEN_CPU_CAPABILITY`` for this CPU and make attention run on it; the backend chosen (None: unset)."""
    requested = (os.environ if environ is None else environ).get(VARIABLE, "")
    if not requested:
        return None
    import torch

    runnable = cpu_paths()
    path = check_path(requested, runnable, cpu_description())
    backend = attention_backend(path, runnable, torch.cpu._is_amx_tile_supported())
    if backend == "math":
        # the flag is named for CUDA but is ATen's global switch; the CPU's SDPA dispatch reads it too
        torch.backends.cuda.enable_flash_sdp(False)
        print(describe(path, runnable, has_amx=True), file=sys.stderr)
    return backend


def describe(path: str, runnable: list[str], has_amx: bool) -> str:
    """One line: what kernel path ``path`` means on this CPU, attention backend included."""
    if path not in runnable:
        return f"{VARIABLE}={path}: not runnable on this CPU (it runs {runnable})"
    kind = "native" if path == runnable[-1] else f"emulated (native: {runnable[-1]})"
    if attention_backend(path, runnable, has_amx) == "math":
        return (
            f"papo_nb: {VARIABLE}={path} is {kind} on a CPU with AMX, whose flash attention kernel the {path} build "
            "cannot run: scaled-dot-product attention uses SDPA's math backend here (attention roundoff is the math "
            "kernel's; the rest of ATen runs the emulated path)"
        )
    return f"papo_nb: {VARIABLE}={path} is {kind}: scaled-dot-product attention uses torch's own choice of backend"


def main(argv: list[str] | None = None) -> int:
    import torch

    runnable = cpu_paths()
    print(f"this CPU: {cpu_description()}; kernel paths it runs: {runnable}")
    for path in argv or runnable:
        print(describe(path.lower(), runnable, torch.cpu._is_amx_tile_supported()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
