"""titan's own optimizers: each module registers its entry when imported."""

from titan.components.optim import adam_spec, muon_spec  # noqa: F401
