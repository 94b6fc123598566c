"""titan's own registrations, loaded like a plugin's (titan.config.extensions imports this on
first use): each module registers its entries and sections when imported. Converters apply by
their spec's order, not by the order here."""

# the data's plan checks first: a dataset's problem is named before what it makes fail later
from titan.components.data import checks as data_checks  # noqa: F401, I001

# then in the order --help lists their sections; callbacks before validation's and
# profiling's, which register with their sections after titan's own (GC, per-rank times, the
# metrics writers)
from titan.components.optim import optimizer_spec, lr_scheduler_spec  # noqa: F401
from titan.parallelisms import sections as parallelism_sections  # noqa: F401
from titan.components.checkpoint import spec as checkpoint_spec  # noqa: F401
from titan.components.observability import metrics_spec, writers  # noqa: F401
from titan.components.training import callbacks  # noqa: F401
from titan.components.training import validation_spec  # noqa: F401
from titan.components.observability import profiling_spec  # noqa: F401
from titan.components.fault_tolerance import spec as fault_tolerance_spec  # noqa: F401
from titan.components.data import chat_spec  # noqa: F401
from titan.components.lora import spec as lora_spec  # noqa: F401
from titan.components.optim import builtin as optimizers  # noqa: F401
from titan.components.quantization import float8_spec  # noqa: F401
from titan.components.training import chunked_loss_spec, terms  # noqa: F401
from titan.components.fault_tolerance import injection_spec  # noqa: F401
