"""titan's own registrations, loaded like a plugin's (titan.config.extensions imports this on
first use): each module registers its entries and sections when imported. Converters apply by
their spec's order, not by the order here."""

from titan.components.data import chat_spec  # noqa: F401
from titan.components.lora import spec as lora_spec  # noqa: F401
from titan.components.observability import writers  # noqa: F401
from titan.components.optim import builtin as optimizers  # noqa: F401
from titan.components.quantization import float8_spec  # noqa: F401
from titan.components.training import callbacks, chunked_loss_spec, terms  # noqa: F401
