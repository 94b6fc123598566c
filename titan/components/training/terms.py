"""Terms of the training objective beside the cross-entropy, registered by name (a z-loss on
the output logits, say), each with its own config section; torch-free, as every registry's
entries are (titan.components.training.objective computes them)."""

from dataclasses import dataclass
from typing import ClassVar

from titan.config import extensions
from titan.config.entry import Entry


@dataclass(frozen=True)
class TermSpec(Entry):
    """A term: `name` is the key it is logged under, and its name in errors; build:
    "module:function", function(job) -> Term, or None where the run does not use it."""

    kind: ClassVar[str] = "objective term"


class Term:
    """A term on the output logits: `token_sum` is its sum over the tokens the loss counts
    (labels not IGNORE_INDEX), which the objective turns into a mean over the step's counted
    tokens, as it does the cross-entropy; `weight` scales it in what backward differentiates
    (the logged value is unweighted). `fields` names the batch's fields it reads beside the
    labels (a per-token weight, an advantage): `token_sum` gets them as a mapping, this
    microbatch's, cut as the labels are on every layout (pipeline microbatches, sequence
    shards)."""

    weight: float = 1.0
    fields: tuple[str, ...] = ()

    def token_sum(self, logits, labels, fields=None):
        raise NotImplementedError


_TERMS = extensions.Registry(TermSpec.kind)
unregister_term = _TERMS.remove


def register_term(spec: TermSpec) -> None:
    extensions.said_once("register_term(spec)", "titan.config.extensions.register(spec)")
    extensions.register(spec)


def build_terms(job) -> dict[str, Term]:
    """This run's terms by name, in registration order."""
    made = {spec.name: extensions.load(spec.build)(job) for spec in _TERMS.entries.values()}
    return {name: term for name, term in made.items() if term is not None}
