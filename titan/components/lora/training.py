"""LoRA as a model converter: adapters on the meta model, initialized after the base; training
checkpoints hold the adapters and record their settings; a final export writes the merged model
and, beside it, the adapters as a PEFT folder."""

import logging
from pathlib import Path

from torch import nn

from titan.components.converters import Converter
from titan.components.lora.adapters import apply_lora, init_adapters, is_adapter, merged_state
from titan.components.lora.peft_export import PeftExportError, write_peft_adapter

logger = logging.getLogger(__name__)


def adapter_exporter(parts: list[nn.Module], cfg, spec, args):
    """What a final HF export runs on its folder: the adapters as a PEFT folder (`adapter/`);
    None without adapters or an HF adapter for the family."""
    if spec.state_dict_adapter is None:
        return None

    def export(folder: Path) -> None:
        hf = spec.state_dict_adapter(args)
        try:
            out = write_peft_adapter(parts, cfg, hf, folder / "adapter")
        except PeftExportError as e:
            logger.warning("no PEFT adapter folder: %s", e)
            return
        logger.info("LoRA adapters written for PEFT to %s", out)

    return export


def log_trainable(parts: list[nn.Module], cfg, pipelined: bool) -> None:
    trainable = sum(p.numel() for part in parts for p in part.parameters() if p.requires_grad)
    logger.info(
        "LoRA rank %d, alpha %g on %s: %.3fM trainable parameters%s, the rest frozen",
        cfg.rank,
        cfg.alpha,
        ", ".join(cfg.target_modules),
        trainable / 1e6,
        " in this rank's stages" if pipelined else "",
    )


class LoraConverter(Converter):
    adds_parameters = True

    def __init__(self, job):
        self.cfg = job.lora
        self.base = job.checkpoint.initial_load_path

    def convert(self, model: nn.Module) -> None:
        apply_lora(model, self.cfg)

    def init_weights(self, part: nn.Module, seed: int) -> None:
        init_adapters(part, seed)

    def describe(self, parts: list[nn.Module], pipelined: bool) -> None:
        log_trainable(parts, self.cfg, pipelined)
        if not self.base:
            logger.warning(
                "LoRA without checkpoint.initial_load_path: the adapters train on a frozen "
                "base of random weights; point checkpoint.initial_load_path at the model to "
                "fine-tune (with checkpoint.initial_load_in_hf for an HF folder)"
            )

    def trained(self):
        return is_adapter

    def merge(self, state: dict, parts: list[nn.Module]) -> dict:
        return merged_state(state, parts)

    def identity(self) -> dict:
        cfg = self.cfg
        return {"rank": cfg.rank, "alpha": cfg.alpha, "target_modules": cfg.target_modules}

    def exporter(self, parts: list[nn.Module], train_spec, model_args):
        return adapter_exporter(parts, self.cfg, train_spec, model_args)
