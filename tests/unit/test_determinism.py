"""training.deterministic turns on torch's deterministic algorithms on every rank, and for the
compiler too when the model is compiled; without compile it does not import inductor (1.4 s of
every rank's start on a 2-core CPU)."""

import subprocess
import sys

from titan.runtime.paths import REPO_ROOT

CHECK = """
import sys, torch
from titan.assembly.determinism import set_determinism

set_determinism(0, True, compiling=False)
assert torch.are_deterministic_algorithms_enabled()
assert "torch._inductor.config" not in sys.modules and "torch._dynamo" not in sys.modules
set_determinism(0, True, compiling=True)
import torch._inductor.config as inductor_config
assert torch.are_deterministic_algorithms_enabled() and inductor_config.deterministic
print("ok")
"""


def test_deterministic_mode_without_compile_leaves_inductor_unimported():
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
