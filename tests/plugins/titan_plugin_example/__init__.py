"""An out-of-tree titan plugin: a model family, an optimizer, a metrics writer, a callback and a
model converter, each with a config section of its own, and a dataset name; nothing in titan/
knows their names.

    PYTHONPATH=tests/plugins ./run_train.sh --job.custom_import titan_plugin_example \
        --model.name gelu_llama --optimizer.name SGD --csv_metrics.enable --loss_ema.enable \
        --model.converters freeze

Importing the package registers all six (titan imports it, in the launcher and in every
worker, before it reads the config).
"""

from titan_plugin_example import data, family, freeze, loss_ema, optimizer, writer  # noqa: F401
