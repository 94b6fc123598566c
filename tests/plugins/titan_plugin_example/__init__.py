"""An out-of-tree titan plugin: a model family, an optimizer and a metrics writer, each with a
config section of its own, and nothing in titan/ that knows their names.

    PYTHONPATH=tests/plugins ./run_train.sh --job.custom_import titan_plugin_example \
        --model.name gelu_llama --optimizer.name SGD --csv_metrics.enable

Importing the package registers all three (titan imports it, in the launcher and in every
worker, before it reads the config).
"""

from titan_plugin_example import family, optimizer, writer  # noqa: F401
