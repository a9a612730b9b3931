"""Regenerate papo_nb/workbook/config/vllm_sampling_fields.json: the fields of vLLM's ``SamplingParams`` in every
vLLM release that a supported TRL release accepts (its ``vllm`` extra), read from each release's wheel on PyPI
(``vllm/sampling_params.py``, parsed with ``ast``: nothing is imported, vLLM needs CUDA).

    .venv/bin/python scripts/vllm_sampling_fields.py      # about 10 GB of wheels, downloaded one at a time

TRL builds ``SamplingParams(**generation_kwargs)`` in colocate mode (trl/generation/vllm_generation.py) and in
``trl vllm-serve`` (trl/scripts/vllm_serve.py), so every key of ``generation_kwargs`` must be one of these fields.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.version import Version

OUT = Path(__file__).resolve().parents[1] / "papo_nb" / "workbook" / "config" / "vllm_sampling_fields.json"
# Each supported TRL release's extra: trl-1.9.1 "vllm>=0.17.0,<=0.25.1", trl-1.16.0 "vllm>=0.22.0,<=0.31.0"
# (Requires-Dist in the wheels' METADATA; trl.import_utils.is_vllm_available warns outside the same range).
TRL_VLLM_RANGES = {"1.9.1": ("0.17.0", "0.25.1"), "1.16.0": ("0.22.0", "0.31.0")}


def released_versions() -> list[str]:
    """Every vLLM release on the index inside one of the ranges, oldest first."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm"], capture_output=True, text=True, check=True
    ).stdout
    versions = re.search(r"Available versions: (.*)", listing).group(1).split(", ")
    inside = [
        v
        for v in versions
        if not Version(v).is_prerelease
        and any(Version(lo) <= Version(v) <= Version(hi) for lo, hi in TRL_VLLM_RANGES.values())
    ]
    return sorted(inside, key=Version)


def sampling_fields(source: str) -> list[str]:
    """The public annotated fields of ``class SamplingParams`` (msgspec Struct fields are its constructor's)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "SamplingParams":
            return [
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and not item.target.id.startswith("_")
            ]
    raise ValueError("no class SamplingParams in vllm/sampling_params.py")


def release_fields(version: str) -> list[str]:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"vllm=={version}",
             "-d", folder, "-q"],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(folder).glob("vllm-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            return sampling_fields(archive.read("vllm/sampling_params.py").decode())


def main() -> None:
    releases = {}
    for version in released_versions():
        releases[version] = release_fields(version)
        print(version, len(releases[version]), flush=True)
    common = sorted(set.intersection(*(set(f) for f in releases.values())))
    OUT.write_text(
        json.dumps(
            {
                "source": "vllm/sampling_params.py, class SamplingParams, in each release's wheel on PyPI",
                "command": ".venv/bin/python scripts/vllm_sampling_fields.py",
                "trl_vllm_ranges": TRL_VLLM_RANGES,
                "in_every_release": common,
                "releases": releases,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
