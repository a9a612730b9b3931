"""scripts/chromium.sh, the one place chromium is installed for the browser tests: scripts/test.sh and .ci/run both
call it; where chromium is there it does nothing, and where this machine cannot install it, it says in one line
which tests will skip and how to get them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "chromium.sh"
BROWSER_TESTS = len(re.findall(r"^def test_", (ROOT / "tests" / "test_browser.py").read_text(), flags=re.M))


def run(env: dict, path: str | None = None) -> subprocess.CompletedProcess:
    environment = {"PATH": path or os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env}
    return subprocess.run(["bash", str(SCRIPT)], env=environment, capture_output=True, text=True, timeout=60)


def test_both_entry_points_call_the_one_script_and_neither_installs_on_its_own():
    for caller in (ROOT / ".ci" / "run", ROOT / "scripts" / "test.sh"):
        lines = [line.strip() for line in caller.read_text().splitlines()]
        assert "bash scripts/chromium.sh" in lines, caller
        assert not any("apt-get" in line and not line.startswith("#") for line in lines), caller
    assert os.access(SCRIPT, os.X_OK)


def test_a_present_browser_is_left_alone():
    result = run({"PAPO_NB_CHROMIUM": shutil.which("true")})
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_where_it_cannot_install_it_says_which_tests_skip_and_how_to_get_them(tmp_path):
    result = run({"PAPO_NB_CHROMIUM": str(tmp_path / "none"), "CHROMIUM_INSTALL": "0"})
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 1, result.stdout
    line = result.stdout
    assert f"the {BROWSER_TESTS} browser tests in tests/test_browser.py will skip" in line
    assert "sudo apt-get install -y chromium" in line and "PAPO_NB_CHROMIUM=" in line
    bin_dir = tmp_path / "bin"  # a machine without apt-get: bash and the few tools the script reads with
    bin_dir.mkdir()
    for tool in ("bash", "grep", "id", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    result = run({"PAPO_NB_CHROMIUM": str(tmp_path / "none")}, path=str(bin_dir))
    assert result.returncode == 0 and "cannot install it here" in result.stdout, (result.stdout, result.stderr)
    assert len(result.stdout.splitlines()) == 1
