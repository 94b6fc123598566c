"""muP's converter entry (on when `mup.base_width` > 0) and its [mup] section; torch-free (the
converter is titan.components.mup.converter.MupConverter)."""

from dataclasses import dataclass

from titan.components.converters import ConverterSpec
from titan.config.entry import register
from titan.config.job_config import opt

# dense families whose parameters the width rules know (titan.components.mup.rules)
FAMILIES = ("llama3", "qwen3")
# optimizers whose hidden-matrix lr rule is known: Adam's 1/m, Muon's by its update scale
OPTIMIZERS = ("AdamW", "Adam", "Muon")


@dataclass
class Mup:
    base_width: int = opt(
        0,
        "muP (maximal update parametrization, docs/mup.md): the model dim at which the "
        "hyper-parameters were tuned; a model of dim d trains with the width multiplier "
        "m = d / base_width (hidden init std / sqrt(m), hidden Adam lr / m, logits / m, "
        "attention scale 1/head_dim). 0: off",
    )
    base_head_dim: int = opt(
        0,
        "The head_dim of the base model: the attention scale is sqrt(base_head_dim) / "
        "head_dim (1/sqrt(head_dim) at the base). 0: the family's head_dim at dim = "
        "base_width (llama3: base_width / n_heads; qwen3: its fixed head_dim)",
    )


def check(job) -> None:
    from titan.config.manager import require_all

    m = job.mup
    require_all(
        job,
        (
            (m.base_width > 0, "mup.base_width", "must be > 0 (the base model's dim)"),
            (m.base_head_dim >= 0, "mup.base_head_dim", "must be >= 0 (0: derived)"),
            (
                job.optimizer.name in OPTIMIZERS,
                "optimizer.name",
                f"muP's lr rules are defined for {', '.join(OPTIMIZERS)}; use one of them or "
                "set mup.base_width = 0",
            ),
            (
                job.lora.rank == 0,
                "lora.rank",
                "muP parametrizes pretraining from its own init; LoRA fine-tunes a given "
                "model: use one of them",
            ),
        ),
    )


def plan_check(job, plan) -> None:
    """A dense family the rules cover, and a base head width."""
    from titan.config.manager import require

    model_args = plan.model_args

    dense = not any(model_args.is_moe_layer(i) for i in range(model_args.n_layers))
    require(
        job,
        job.model.name in FAMILIES and dense,
        "model.name",
        f"muP supports the dense {' and '.join(FAMILIES)} models, not "
        f"{job.model.name} {job.model.flavor}; train it without muP (mup.base_width = 0)",
    )
    ck = job.checkpoint
    require(
        job,
        not (
            getattr(model_args, "tie_word_embeddings", False)
            and ck.enable
            and (ck.last_save_model_only or ck.last_save_in_hf)
        ),
        "checkpoint.last_save_in_hf" if ck.last_save_in_hf else "checkpoint.last_save_model_only",
        "the export folds muP's logit multiplier into the output matrix, which this flavor's "
        "embedding shares: train untied, or keep the training checkpoint (no export)",
    )
    base_hd = job.mup.base_head_dim or model_args.with_updates(dim=job.mup.base_width).head_dim
    require(
        job,
        base_hd > 0,
        "mup.base_head_dim",
        f"the family gives no head width at dim = {job.mup.base_width}: set it",
    )


register(
    ConverterSpec(
        "mup",
        build="titan.components.mup.converter:build",
        enabled=lambda job: job.mup.base_width != 0,
        check=check,
        plan_check=plan_check,
        section="mup",
        options=Mup,
        # after the rewrites of layers (float8, the chunked loss): it sets attributes of the
        # model and its attention modules, whatever their class
        order=40,
    )
)
