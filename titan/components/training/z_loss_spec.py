"""PaLM's z-loss as a term of the objective (`training.z_loss_weight`), registered like a
plugin's terms; torch-free (the term is z_loss.py)."""

from titan.components.training.terms import TermSpec
from titan.config.entry import register


def check(job) -> None:
    from titan.config.manager import require

    w = job.training.z_loss_weight
    require(job, w >= 0, "training.z_loss_weight", "must be >= 0 (0: off; PaLM used 1e-4)")


register(TermSpec("z_loss", build="titan.components.training.z_loss:build", check=check))
