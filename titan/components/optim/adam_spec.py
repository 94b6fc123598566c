"""Adam and AdamW in the optimizer registry (torch-free; the builder is titan.components.optim
.adam)."""

from titan.components.optim.registry import OptimizerSpec
from titan.config.entry import register

_ITEMSIZE = {"float32": 4, "bfloat16": 2}


def adam_state_bytes(name, shape, elements, cfg, options) -> int:
    """Two moments per element in optimizer.state_dtype, and a float32 step count."""
    return 2 * elements * _ITEMSIZE[cfg.state_dtype] + 4


def check_adam(job) -> None:
    from titan.config.manager import require

    o = job.optimizer
    require(job, 0 <= o.beta1 < 1, "optimizer.beta1", "must lie in [0, 1)")
    require(job, 0 <= o.beta2 < 1, "optimizer.beta2", "must lie in [0, 1)")
    require(job, o.eps > 0, "optimizer.eps", "must be > 0")


for _name in ("AdamW", "Adam"):
    register(
        OptimizerSpec(
            _name,
            build="titan.components.optim.adam:build",
            state_bytes=adam_state_bytes,
            check=check_adam,
        )
    )
