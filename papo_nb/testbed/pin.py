"""Rebuild the pinned testbed weights the package ships and rewrite their manifest.

    python -m papo_nb.testbed.pin [NAME ...]    # default: every testbed

Builds each testbed's seed-0 policy fresh on ATen's ``default`` kernel path (the one path every x86 CPU runs, so the
build is the same on any machine with this torch wheel), copies the folder into ``papo_nb/testbed/pinned/<name>`` and
records each file's SHA-256 and how it was built. Results pages and README numbers name the weights by that hash, so
rebuilding means regenerating them too (docs/study.md, docs/smoke.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

KERNEL_PATH = "default"


def pin(names: list[str], cache_dir: str | None = None) -> dict:
    """Pin ``names``; ``cache_dir`` reuses builds already made there (on this kernel path), else a fresh temp cache."""
    import torch

    from papo_nb.testbed.models import COMPLETE_MARKER
    from papo_nb.testbed.perception import TESTBED_VERSION
    from papo_nb.testbed.policy import PINNED_MANIFEST, PINNED_ROOT, build_testbed, file_sha256

    manifest = json.loads(PINNED_MANIFEST.read_text()) if PINNED_MANIFEST.exists() else {}
    with tempfile.TemporaryDirectory() as scratch:
        cache = cache_dir or scratch
        for name in names:
            built = build_testbed(name, seed=0, cache_dir=cache)
            target = PINNED_ROOT / name
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(built, target, ignore=shutil.ignore_patterns(COMPLETE_MARKER))
            manifest[name] = {
                "seed": 0,
                "testbed_version": TESTBED_VERSION,
                "built_with": {"ATEN_CPU_CAPABILITY": KERNEL_PATH, "torch": torch.__version__, "threads": 1},
                "sha256": {f.name: file_sha256(f) for f in sorted(target.iterdir())},
            }
            print(f"pinned testbed:{name}: {manifest[name]['sha256']['model.safetensors']}", flush=True)
    PINNED_MANIFEST.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get("ATEN_CPU_CAPABILITY") != KERNEL_PATH:
        # ATen reads the variable once, when torch loads: run the build in a fresh interpreter that has it
        env = {**os.environ, "ATEN_CPU_CAPABILITY": KERNEL_PATH}
        return subprocess.call([sys.executable, "-m", "papo_nb.testbed.pin", *argv], env=env)
    from papo_nb.testbed.perception import TESTBEDS

    unknown = [n for n in argv if n not in TESTBEDS]
    if unknown:
        print(f"unknown testbed name(s) {unknown}; allowed: {list(TESTBEDS)}", file=sys.stderr)
        return 2
    pin(argv or list(TESTBEDS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
