"""Parameter counts of a decoder's args (a ModelArgs of titan/models/spec.py), torch-free:
a family's args say what one block holds (`layer_params`), and the totals, the active share
and the per-block costs a pipeline split balances follow from it."""

from titan.models.args_base import ModelArgsBase


class DecoderParamCount(ModelArgsBase):
    """Mixin for args with dim, n_layers, vocab_size, tie_word_embeddings and
    `layer_params(layer_id, active)`: one block's parameters (`active`: those one token uses,
    an MoE block's routed experts counted top_k times, not n_experts)."""

    def layer_params(self, layer_id: int, active: bool = False) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define layer_params")

    def layer_costs(self) -> list[int]:
        return [self.layer_params(i, active=True) for i in range(self.n_layers)]

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """Parameters; `active`: those one token uses (its top_k routed experts, not all)."""
        d = self.dim
        total = sum(self.layer_params(i, active) for i in range(self.n_layers))
        total += d + self.vocab_size * d  # final norm + output
        # a tied embedding is the output matrix: counted once, and its matmul is in FLOPs
        separate_embedding = include_embedding and not self.tie_word_embeddings
        return total + (self.vocab_size * d if separate_embedding else 0)
