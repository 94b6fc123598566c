"""titan's own registrations, loaded like a plugin's (titan.config.extensions imports this on
first use): each module registers its entries, sections and checks when imported, in the
order below, which is --help's order of their sections and the order their checks run.
Converters apply by their spec's order, not by the order here."""

import importlib

from titan.config.family_options import register_titan_families

# the data's plan checks first: a dataset's problem is named before what it makes fail later
importlib.import_module("titan.components.data.checks")
# the families' sections ([llama3], ...) right after the core's
register_titan_families()
for module in (
    "titan.components.optim.optimizer_spec",
    "titan.components.optim.lr_scheduler_spec",
    "titan.parallelisms.sections",
    "titan.components.checkpoint.spec",
    "titan.components.observability.metrics_spec",
    "titan.components.observability.writers",
    # titan's own callbacks (GC, per-rank times, the metrics writers) before validation's and
    # profiling's, which register with their sections
    "titan.components.training.callbacks",
    # the average before the callbacks that validate or evaluate on it
    "titan.components.training.ema_spec",
    "titan.components.training.validation_spec",
    "titan.components.observability.profiling_spec",
    "titan.components.training.stability_spec",
    "titan.components.evaluation.eval_spec",
    "titan.components.fault_tolerance.spec",
    "titan.components.data.chat_spec",
    "titan.components.lora.spec",
    "titan.components.mup.spec",
    "titan.components.optim.builtin",
    "titan.components.quantization.float8_spec",
    "titan.components.training.chunked_loss_spec",
    "titan.components.optim.qk_clip_spec",
    "titan.components.training.terms",
    "titan.components.training.z_loss_spec",
    "titan.components.fault_tolerance.injection_spec",
):
    importlib.import_module(module)
