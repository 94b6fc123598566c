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
    require(
        job,
        "float8" not in job.model.converters or "output" in job.float8.filter_fqns,
        "training.loss_chunk_tokens",
        "needs the output layer left out of float8 (float8.filter_fqns with 'output')",
    )


register(
    ConverterSpec(
        "chunked_loss",
        build="titan.components.training.chunked_loss:ChunkedLossConverter",
        enabled=lambda job: job.training.loss_chunk_tokens != 0,
        check=check,
        order=20,
    )
)
