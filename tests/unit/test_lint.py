"""The house style holds on every file: ruff's lint rules and formatter (pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.needs("ruff")
@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "--no-cache", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (
        f"ruff {' '.join(command)}: fix with `ruff format . && ruff check --fix .`\n"
        f"{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    )
