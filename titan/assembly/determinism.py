"""Seeding and deterministic kernels, set once a process starts."""

import os
import sys

import torch


def set_determinism(seed: int, deterministic: bool, compiling: bool) -> None:
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if compiling or "torch._inductor.config" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # the public call imports inductor (1.4 s a rank on 2 CPU cores) only to set
            # inductor's own flag, which nothing reads unless the model is compiled
            torch._C._set_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
