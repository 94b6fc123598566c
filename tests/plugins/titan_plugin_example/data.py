"""A dataset name: the bundled corpus under another name, as a plugin names its own data."""

from titan.components.data.dataset import register_dataset

register_dataset("plugin_corpus", "assets/corpus/kjv_train.jsonl")
