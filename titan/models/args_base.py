"""The optional members of a family's ModelArgs (titan/models/spec.py), declared once with the
value generic code takes when a family has no such thing. A family's args class inherits them
(the common decoder's DecoderParamCount does) and overrides what it has; generic code calls
them, never asks whether they exist. Torch-free, as args modules are."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from titan.models.common.moe_args import MoEArgs

# what register_train_spec checks each flavor has
OPTIONAL_MEMBERS = (
    "training_knobs",
    "context_len",
    "moe_args",
    "is_moe_layer",
    "problems",
    "layer_costs",
    "layout_problems",
    "block_count",
    "masked_labels_problem",
    "training_blocks",
    "upcycled",
    "input_costs",
)


class ModelArgsBase:
    # fields a run may change without changing the model (titan.components.checkpoint.identity)
    training_knobs: ClassVar[tuple[str, ...]] = ()
    # the context the model was published for (HF max_position_embeddings); None: max_seq_len
    context_len: int | None = None
    # the field counting blocks after the main stack that only training uses (DeepSeek-V3's
    # multi-token-prediction depths): a base checkpoint with more of them loads without them
    training_blocks: ClassVar[str | None] = None

    def moe_args(self) -> MoEArgs | None:
        """The MoE layers' settings with this run's balancing; None for a dense model."""
        return None

    def is_moe_layer(self, layer_id: int) -> bool:
        return False

    def problems(self) -> list[str]:
        """What is wrong with these settings, each naming its fields (empty: nothing)."""
        return []

    def layout_problems(self, dims) -> list[str]:
        """What this model cannot do in a parallel layout (`dims`: titan.parallelisms'
        ParallelDims; its degrees tp, cp, pp, ep, ...), each naming the degree and the fix
        (empty: it trains in any layout the generic checks accept)."""
        return []

    def masked_labels_problem(self) -> str | None:
        """Why this model cannot train on labels that mask tokens (chat data masks its
        prompts), naming the fix; None: it can."""
        return None

    def block_count(self) -> int:
        """The blocks the model holds: the main stack's n_layers and any after it (DeepSeek-V3's
        multi-token-prediction depths), numbered on as layers.<n_layers>, ..."""
        return self.n_layers

    def upcycled(self, n_experts: int, top_k: int, granularity: int = 1) -> ModelArgsBase | None:
        """This dense model in its family's MoE form (titan.tools.upcycle): routed experts
        1/granularity of the FFN's width, softmax routing whose k weights sum to 1, in place of
        every block's FFN; None: the family has no MoE form."""
        return None

    def input_costs(self, batch: dict) -> tuple[float, dict[str, int]]:
        """(the training FLOPs of a batch's inputs beyond what flops_per_token counts of its
        tokens, the count of each kind of its tokens that is not text): a vision tower's over
        the batch's images, and its image tokens. `batch` is on the host (no device read)."""
        return 0.0, {}

    def layer_costs(self) -> list[int] | None:
        """Each block's parameters one token uses, which a pipeline split balances when blocks
        differ (dense and MoE blocks); None: equal blocks."""
        return None
