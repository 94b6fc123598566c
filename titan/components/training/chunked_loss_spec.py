"""The chunked loss's converter entry: on when `training.loss_chunk_tokens` > 0 (or
model.converters names "chunked_loss"); torch-free (the converter is
titan.components.training.chunked_loss)."""

from titan.components.converters import ConverterSpec
from titan.config.entry import register


def check(job) -> None:
    from titan.config.manager import require

    n = job.training.loss_chunk_tokens
    require(job, n >= 0, "training.loss_chunk_tokens", "must be >= 0 (0: off)")
    require(
        job,
        n > 0,
        "training.loss_chunk_tokens",
        "model.converters names 'chunked_loss': set the tokens of a chunk here",
    )
    require(
        job,
        job.parallelism.tensor_parallel_degree == 1,
        "training.loss_chunk_tokens",
        "is for layouts without tensor parallelism: under TP the loss is already "
        "vocabulary-parallel (each rank holds 1/tp of the logits); set it to 0",
    )


def plan_check(job, plan) -> None:
    """No term of the objective reads batch fields (the output layer gets the labels alone),
    and the output layer is still a plain linear layer where the chunked loss applies: no
    converter before it (in their order) rewrote it."""
    from torch import nn

    from titan.components.converters import Converters, enabled_specs
    from titan.components.training.terms import build_terms
    from titan.config.manager import require

    reading = {name: list(t.fields) for name, t in build_terms(job).items() if t.fields}
    require(
        job,
        not reading,
        "training.loss_chunk_tokens",
        f"computes the objective's terms in the output layer, which gets the labels alone; "
        f"the term(s) {reading} read batch fields: set it to 0, or turn those terms off",
    )

    model = plan.spec.build_meta(plan.model_args)
    for spec, converter in zip(enabled_specs(job), Converters(job).items, strict=True):
        if spec.name == "chunked_loss":
            break
        converter.convert(model)
        output = getattr(model, "output", None)
        require(
            job,
            output is None or type(output) is nn.Linear,
            "training.loss_chunk_tokens",
            f"needs the output layer a plain linear layer, which the {spec.name} converter "
            f"made a {type(output).__name__}: leave the output layer out of it",
        )


register(
    ConverterSpec(
        "chunked_loss",
        build="titan.components.training.chunked_loss:ChunkedLossConverter",
        enabled=lambda job: job.training.loss_chunk_tokens != 0,
        check=check,
        plan_check=plan_check,
        order=20,
    )
)
