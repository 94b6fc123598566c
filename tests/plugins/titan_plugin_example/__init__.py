"""An out-of-tree titan plugin: a model family, an optimizer, a metrics writer, a callback, a
model converter and an objective term, each with a config section of its own, and a dataset
whose samples carry a batch field the family reads; nothing in titan/ knows their names.

    PYTHONPATH=tests/plugins ./run_train.sh --job.custom_import titan_plugin_example \
        --model.name gelu_llama --optimizer.name SGD --csv_metrics.enable --loss_ema.enable \
        --model.converters freeze --logit_l2.weight 1e-4 --training.dataset plugin_corpus

Importing the package registers all seven (titan imports it, in the launcher and in every
worker, before it reads the config).
"""

from titan_plugin_example import (  # noqa: F401
    data,
    family,
    freeze,
    logit_l2,
    loss_ema,
    optimizer,
    writer,
)
