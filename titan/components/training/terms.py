"""Terms of the training objective beside the cross-entropy, registered by name (a z-loss on
the output logits, say), each with its own config section; torch-free, as every registry's
entries are (titan.components.training.objective computes them)."""

from collections.abc import Callable
from dataclasses import dataclass

from titan.config import extensions


@dataclass(frozen=True)
class TermSpec:
    # the key it is logged under, and the term's name in errors
    name: str
    # "module:function"; function(job) -> Term, or None where the run does not use it
    build: str
    check: Callable | None = None  # check(job) raises ConfigError
    section: str | None = None
    options: type | None = None


class Term:
    """A term on the output logits: `token_sum` is its sum over the tokens the loss counts
    (labels not IGNORE_INDEX), which the objective turns into a mean over the step's counted
    tokens, as it does the cross-entropy; `weight` scales it in what backward differentiates
    (the logged value is unweighted)."""

    weight: float = 1.0

    def token_sum(self, logits, labels):
        raise NotImplementedError


_TERMS = extensions.Registry("objective term")
register_term = _TERMS.add
unregister_term = _TERMS.remove


def build_terms(job) -> dict[str, Term]:
    """This run's terms by name, in registration order."""
    made = {spec.name: extensions.load(spec.build)(job) for spec in _TERMS.entries.values()}
    return {name: term for name, term in made.items() if term is not None}


extensions.register_check(_TERMS.check)
