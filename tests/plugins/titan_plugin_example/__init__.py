"""An out-of-tree titan plugin: a model family, an optimizer and a metrics writer, each with a
config section of its own, and a dataset name; nothing in titan/ knows their names.

    PYTHONPATH=tests/plugins ./run_train.sh --job.custom_import titan_plugin_example \
        --model.name gelu_llama --optimizer.name SGD --csv_metrics.enable

Importing the package registers all four (titan imports it, in the launcher and in every
worker, before it reads the config).
"""

from titan_plugin_example import data, family, optimizer, writer  # noqa: F401
