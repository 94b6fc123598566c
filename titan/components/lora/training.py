"""What a run with LoRA changes around the model: which of its state a checkpoint holds, what
a final export writes beside the merged model, and the line that says what trains."""

import logging
from pathlib import Path

from torch import nn

from titan.components.checkpoint.train_state import ModelState
from titan.components.lora.adapters import is_adapter, merged_state
from titan.components.lora.peft_export import PeftExportError, write_peft_adapter

logger = logging.getLogger(__name__)


def model_state(parts: list[nn.Module], cfg) -> ModelState:
    """The model's checkpoint state (`cfg`: the lora section): with adapters, training saves
    hold them and exports the merged model."""
    if not cfg.rank:
        return ModelState(parts)
    return ModelState(parts, trained=is_adapter, merge=lambda sd: merged_state(sd, parts))


def adapter_exporter(parts: list[nn.Module], cfg, spec, args):
    """What a final HF export runs on its folder: the adapters as a PEFT folder (`adapter/`);
    None without adapters or an HF adapter for the family."""
    if not cfg.rank or spec.state_dict_adapter is None:
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
    if not cfg.rank:
        return
    trainable = sum(p.numel() for part in parts for p in part.parameters() if p.requires_grad)
    logger.info(
        "LoRA rank %d, alpha %g on %s: %.3fM trainable parameters%s, the rest frozen",
        cfg.rank,
        cfg.alpha,
        ", ".join(cfg.target_modules),
        trainable / 1e6,
        " in this rank's stages" if pipelined else "",
    )
