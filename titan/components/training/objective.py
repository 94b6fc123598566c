"""What a training step minimizes, and what it logs of it: named terms with their weights.

- `loss`: the cross-entropy of the labels the data counts, or its chunked form (the output
  layer then computes the sum itself: titan.components.training.chunked_loss). Every term is
  a sum over the counted tokens divided by the step's count of them over the global batch
  (`count`), so gradient accumulation, pipeline microbatches and sequence shards add up to the
  mean over the global batch, whatever the layout.
- Terms on the output logits that a run registers (titan.components.training.terms: PaLM's
  z-loss, `training.z_loss_weight`, or a plugin's), weighted in what backward
  differentiates, logged unweighted under their names. Under the chunked loss the output
  layer computes them chunk by chunk beside the cross-entropy and returns every sum. A term
  that reads batch fields gets them with the labels: `target` stacks them behind the labels,
  so that a pipeline's schedule splits them into its microbatches and context parallelism
  shards them, as it does the labels.
- The model's own terms (an MoE's balancing loss, multi-token prediction), which it computes
  inside forward and attaches to activations (titan.models.common.aux_loss), weighted by the
  family's settings. The objective opens the collector around a step, hands it the layout's
  token split, and logs them under their names (`moe_aux_loss`, `mtp_loss`).

Logged: `loss` stays the cross-entropy alone, comparable with other frameworks.
"""

import contextlib

import torch
import torch.distributed as dist

from titan.components.data.batch import LABELS, Batch
from titan.components.training.loss import IGNORE_INDEX, cross_entropy_sum, plain, reduce_loss
from titan.components.training.terms import Term
from titan.models.common import aux_loss
from titan.models.common.aux_loss import AuxLossCollector, reduce_aux_losses
from titan.parallelisms.token_split import TokenSplit

LOSS = "loss"
CPU = torch.device("cpu")


class Objective:
    def __init__(
        self,
        terms: dict[str, Term],
        tokens_per_rank_step: float,
        cp: int,
        device: torch.device = CPU,
        output_sums: bool = False,
    ):
        """`tokens_per_rank_step`: the step's counted tokens each rank divides by until
        `count` says the step's own; `cp`: the context-parallel degree (each cp rank holds
        1/cp of every sequence); `device`: where the step's values and counts live;
        `output_sums`: the model's output layer returns the sums [cross-entropy, each term]
        instead of logits (a chunked loss, titan.components.training.chunked_loss)."""
        self.terms, self.tokens, self.cp, self.device = terms, tokens_per_rank_step, cp, device
        self.output_sums = output_sums
        # the batch fields the terms read, in a stable order, and each one's kind
        self.fields = tuple(dict.fromkeys(f for term in terms.values() for f in term.fields))
        self._kinds: dict[str, torch.dtype] = {}
        self._values: torch.Tensor | None = None  # this step's, detached: loss, then terms
        self._aux: AuxLossCollector | None = None

    @property
    def names(self) -> list[str]:
        return [LOSS, *self.terms]

    def count(self, labels: list[torch.Tensor], dp_group: dist.ProcessGroup | None) -> torch.Tensor:
        """This step's terms are means over the labels the loss counts (not IGNORE_INDEX) in
        this rank's microbatches' `labels`, summed over `dp_group` (None: this rank alone;
        torchft's replica groups count their own): each rank's share of it, as the count is
        shared by the dp x cp ranks. Returns the count, on the device: nothing waits for it
        (a step with none is caught by titan.components.training.step_guard)."""
        counted = sum((y != IGNORE_INDEX).sum() for y in labels).to(self.device)
        ranks = 1
        if dp_group is not None:
            dist.all_reduce(counted, group=dp_group)
            ranks = dist.get_world_size(dp_group)
        # float64, then float32: what dividing by the Python number it was rounded to
        self.tokens = (counted.clamp(min=1).double() / (ranks * self.cp)).float()
        return counted

    @staticmethod
    def nothing_counted(step: int) -> Exception:
        """The error of a step whose global batch has no counted label: its update would
        change the weights (momentum, weight decay) learning nothing."""
        from titan.components.data.dataset import DataError

        return DataError(
            f"step {step}: no label of the global batch is one the loss counts (all are "
            "masked: prompts or padding only, or chat replies training.seq_len cuts off), so "
            "nothing can be learned; raise training.seq_len or check the data"
        )

    def cross_entropy(self, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed token cross-entropy of the model's output (its logits, or its sums)."""
        return out[0] if self.output_sums else cross_entropy_sum(out, labels)

    def target(self, batch: Batch) -> torch.Tensor:
        """What `loss` takes beside the model's output: the labels, and behind them (a last
        dimension, in float64: exact for labels, ids and float32 values) the fields the terms
        read. One tensor, as a pipeline's loss function gets one."""
        if not self.fields:
            return batch[LABELS]
        missing = [f for f in self.fields if f not in batch]
        if missing:
            from titan.components.data.dataset import DataError

            readers = [n for n, t in self.terms.items() if set(t.fields) & set(missing)]
            raise DataError(
                f"the objective's term(s) {readers} read the batch field(s) {missing}, which "
                f"the training data does not yield (it has {sorted(batch)}): train on a "
                "dataset that adds them (DatasetSpec(fields=...)) or turn the term off"
            )
        self._kinds = {f: batch[f].dtype for f in self.fields}
        parts = [batch[LABELS], *(batch[f] for f in self.fields)]
        return torch.stack([p.double() for p in parts], dim=-1)

    def _labels_and_fields(self, target: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if not self.fields:
            return target, {}
        labels = target[..., 0].long()
        return labels, {f: target[..., i + 1].to(self._kinds[f]) for i, f in enumerate(self.fields)}

    def sums(self, out: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
        """[the cross-entropy, each term] summed over the counted tokens of an output."""
        if self.output_sums:  # the output layer computed them, chunk by chunk
            return list(out.unbind())
        labels, fields = self._labels_and_fields(target)
        ce = cross_entropy_sum(out, labels)
        return [ce, *(_like(_token_sum(t, out, labels, fields), ce) for t in self.terms.values())]

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What backward differentiates for one microbatch's output (a pipeline's loss
        function): the cross-entropy plus the weighted terms, over the step's counted tokens.
        `target`: the microbatch's `target`."""
        values = self.sums(out, target)
        total = values[0]
        for term, v in zip(self.terms.values(), values[1:], strict=True):
            total = total + term.weight * v
        if self._values is not None:  # within a step: kept for the log
            self._values += torch.stack([plain(v.detach()).float() for v in values]) / self.tokens
        return total / self.tokens

    @contextlib.contextmanager
    def step(self, microbatch_weight: float, split: TokenSplit):
        """Around a step's forward and backward: its values start at 0 and the model's own
        terms are collected (`microbatch_weight`: one microbatch's share of the step)."""
        self._values = torch.zeros(len(self.names), device=self.device)
        with AuxLossCollector(microbatch_weight, split) as aux:
            yield
        self._aux = aux

    @contextlib.contextmanager
    def paused(self):
        """Nothing is recorded within: a pipeline stage's shape inference, which runs the
        model (and the loss) on empty tensors."""
        values, self._values = self._values, None
        try:
            with aux_loss.paused():
                yield
        finally:
            self._values = values

    def reduce(
        self, pp_group: dist.ProcessGroup | None, dp_cp_group: dist.ProcessGroup | None
    ) -> torch.Tensor:
        """The step's `loss` and terms over the run, in `names`' order, on the device
        (collective: every rank calls it)."""
        values = self._values
        reduce_loss(values, pp_group=pp_group, dp_cp_group=dp_cp_group)
        return values

    def named(self, values: torch.Tensor) -> dict[str, float]:
        """`reduce`'s values by name, read on the host."""
        return dict(zip(self.names, values.tolist(), strict=True))

    def model_terms(self) -> dict[str, float]:
        """The model's own terms of the last step, summed over all ranks (collective: every
        rank calls it, when the step is logged)."""
        return reduce_aux_losses(self._aux.floats()) if self._aux is not None else {}


def _token_sum(term: Term, logits, labels, fields: dict) -> torch.Tensor:
    if not term.fields:  # a term of the earlier docs takes (logits, labels) alone
        return term.token_sum(logits, labels)
    return term.token_sum(logits, labels, {f: fields[f] for f in term.fields})


def _like(value: torch.Tensor, ce: torch.Tensor) -> torch.Tensor:
    """A term's sum in the cross-entropy's kind: under loss parallelism the cross-entropy is a
    replicated DTensor, and a term computed from the whole logits is the same on every rank."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(ce, DTensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, ce.device_mesh, [Replicate()] * ce.device_mesh.ndim)
    return value
