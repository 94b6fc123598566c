"""LoRA adapters as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors),
which `peft.PeftModel.from_pretrained` loads onto transformers' model of the base.

Names go through the family's HF adapter: an adapter of the weight `layers.0.attention.wq` is
PEFT's `base_model.model.model.layers.0.self_attn.q_proj.lora_{A,B}`. B's rows are the
weight's output rows, so they take the weight's own conversion (Llama's q/k row permutation);
A's columns are the input's, which the conversions of the targeted layers leave in place.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan.components.lora.adapters import adapter_updates
from titan.models.common.moe import GroupedExperts

PEFT_PREFIX = "base_model.model."
# PEFT (0.21, with transformers 5) reads these target names in a model with routed experts as
# the experts' fused weights, whatever layer path precedes them
_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


class PeftExportError(ValueError):
    pass


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu()


def peft_tensors(parts: list[nn.Module], hf_adapter) -> tuple[dict, list[str], list[str]]:
    """({PEFT name: tensor}, the HF names of the adapted modules, why some adapters have no
    PEFT form) of this rank's parts; every rank of a stage must call it (sharded factors are
    gathered)."""
    tensors, modules, problems = {}, [], []
    for part in parts:
        for name, update in adapter_updates(part).items():
            if update.weight != "weight":
                problems.append(
                    f"{name} is a routed experts' weight: titan writes no PEFT form of its "
                    "adapters; the merged export holds them"
                )
                continue
            a, b = (_whole(t) for t in update.factors())
            (hf_name, b_hf), *more = hf_adapter.to_hf({name: b}).items()
            if more or not hf_name.endswith(".weight"):
                problems.append(f"{name} has no single HF linear layer in PEFT's form")
                continue
            module = hf_name.removesuffix(".weight")
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_hf.contiguous()
            modules.append(module)
    return tensors, modules, problems


def write_peft_adapter(parts: list[nn.Module], cfg, hf_adapter, out_dir: Path) -> Path:
    """Write the adapters of all ranks' parts (`cfg`: the lora section) to `out_dir`;
    every rank calls it, rank 0 writes."""
    from safetensors.torch import save_file

    tensors, modules, problems = peft_tensors(parts, hf_adapter)
    routed = any(isinstance(m, GroupedExperts) for part in parts for m in part.modules())
    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold their own
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (tensors, modules, problems, routed))
        tensors = {k: v for t, *_ in gathered for k, v in t.items()}
        modules = sorted({m for _, ms, *_ in gathered for m in ms})
        problems = [p for _, _, ps, _ in gathered for p in ps]
        routed = any(r for *_, r in gathered)
    clash = [m for m in modules if m.rsplit(".", 1)[-1] in _EXPERT_NAMES]
    if routed and clash:
        problems.append(
            f"adapters on {clash[0]} and other FFN layers of a model with routed experts: "
            "PEFT would load them onto the routed experts instead (it takes gate/up/down_proj "
            "for the experts' fused weights); the merged export holds them, or target the "
            "attention projections only"
        )
    if problems:  # every rank decides alike
        raise PeftExportError(problems[0])
    if not dist.is_initialized() or dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": cfg.rank,
            "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout,
            "target_modules": sorted(set(modules)),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "base_model_name_or_path": None,
        }
        (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if dist.is_initialized():
        dist.barrier()
    return out_dir
