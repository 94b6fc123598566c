"""A dataset: the bundled corpus under the plugin's own name, whose samples carry a batch field
the plugin's family reads: `positions`, each token's position within its document (counted
from the BOS that opens it), as packed-sequence trainers pass HF models their position ids.
The family lists the field in `batch_fields`; its RoPE angles follow it."""

from titan.components.data.dataset import DatasetSpec
from titan.config.extensions import register


def document_positions(tokenizer):
    from titan.models.common.documents import document_ids, document_positions

    bos = tokenizer.bos_id

    def fields(sample):
        return {"positions": document_positions(document_ids(sample["input_ids"], bos))}

    return fields


SPEC = DatasetSpec(
    "plugin_corpus", "assets/corpus/kjv_train.jsonl", fields=f"{__name__}:document_positions"
)
register(SPEC)
