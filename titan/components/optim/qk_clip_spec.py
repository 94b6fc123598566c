"""QK-clip's converter entry: on when `optimizer.qk_clip_threshold` > 0; torch-free (the
converter is titan.components.optim.qk_clip)."""

from titan.components.converters import ConverterSpec
from titan.config.entry import register

KEY = "optimizer.qk_clip_threshold"


def check(job) -> None:
    from titan.config.manager import require_all

    tau = job.optimizer.qk_clip_threshold
    require_all(
        job,
        (
            (tau > 0, KEY, "must be > 0 (0: off; Kimi K2 used 100)"),
            (
                job.parallelism.context_parallel_degree == 1,
                KEY,
                "needs each head's logits over the whole sequence on one rank, which context "
                "parallelism splits; set parallelism.context_parallel_degree = 1 or turn "
                "QK-clip off (0)",
            ),
        ),
    )


def plan_check(job, plan) -> None:
    """A model whose attention can be clipped: QK-clip's rows to rescale exist, and no q/k
    norm undoes them (Qwen3 normalizes each head's query and key after the projection)."""
    from titan.config.manager import require

    train_spec, model_args = plan.spec, plan.model_args

    model = train_spec.build_meta(model_args)
    attention = [m for m in model.modules() if hasattr(m, "qk_clip_scales")]
    require(job, bool(attention), KEY, "this model has no attention QK-clip knows how to clip")
    require(
        job,
        not any(getattr(m, "normalizes_qk", False) for m in attention),
        KEY,
        "the model normalizes each head's query and key after their projections (q/k "
        "RMSNorm), which undoes a rescaled projection (and bounds the logits itself); set 0",
    )
    from titan.components.converters import Converters

    keeps_own = Converters(job).partial
    require(
        job,
        keeps_own is None,
        KEY,
        "rescales the query/key weights, which a converter that trains only its own "
        f"parameters ({type(keeps_own).__name__}) freezes; turn one of them off (0 here)",
    )


register(
    ConverterSpec(
        "qk_clip",
        build="titan.components.optim.qk_clip:QKClipConverter",
        enabled=lambda job: job.optimizer.qk_clip_threshold != 0,
        check=check,
        plan_check=plan_check,
        order=40,
    )
)
