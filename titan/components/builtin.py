"""titan's own registrations, loaded the way a plugin's are (titan.config.extensions
.import_plugin, by module name or by file): each registers its entries when imported, in the
order below, which is --help's order of their sections and the order their checks run.
Converters apply by their spec's order, not by the order here. A new component or family adds
its line here."""

from pathlib import Path

from titan.config.entry import Entry, register
from titan.config.extensions import import_plugin

_MODELS = Path(__file__).resolve().parent.parent / "models"

# the data's checks first (after the core's, titan.config.entry.BUILTIN): a dataset's problem
# is named before what it makes fail later
MODULES = (
    "titan.components.data.checks",
    # the families' sections ([llama3], ...): files, not their packages (which import torch)
    *(
        str(_MODELS / family / "options.py")
        for family in (
            "deepseek_v3",
            "gpt_oss",
            "llama3",
            "qwen3",
            "qwen3_5",
            "qwen3_next",
            "qwen3_vl",
        )
    ),
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
    "titan.components.data.images_spec",
    "titan.components.lora.spec",
    "titan.components.training.frozen_spec",
    "titan.components.mup.spec",
    "titan.components.optim.builtin",
    "titan.components.quantization.float8_spec",
    "titan.components.training.chunked_loss_spec",
    "titan.components.optim.qk_clip_spec",
    "titan.components.training.terms",
    "titan.components.training.z_loss_spec",
    "titan.components.fault_tolerance.injection_spec",
    "titan.components.converters",
)
for module in MODULES:
    import_plugin(module)

# the enabled converters built together, after each one's own plan check
from titan.components.converters import check_names, check_together  # noqa: E402

register(Entry("converters", check=check_names, plan_check=check_together))
