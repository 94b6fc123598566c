"""The plain model of an adapters-only checkpoint (a LoRA run's training save): its recorded
base, read from where the run loaded it (a titan checkpoint or an HF folder) or made again
from the seed it was initialized with, with the adapters folded into their weights. What
generation and HF export read."""

from pathlib import Path
from types import SimpleNamespace

import torch

from titan.components.checkpoint.folders import CheckpointError, load_dcp_model_state


def adapters_of(record: dict | None) -> dict:
    """The adapters' settings of a marker's model record ({} for a whole model)."""
    return (record or {}).get("adapters") or {}


def merged_state(path: Path, spec, args, adapters: dict) -> dict[str, torch.Tensor]:
    """Full CPU tensors by titan name: the base of the checkpoint `path` with its adapters
    (`adapters`: the settings its marker records) folded in."""
    from titan.components.lora.adapters import apply_lora, is_adapter
    from titan.components.lora.adapters import merged_state as fold

    base = adapters.get("base") or {}
    if "path" in base:
        base_path = Path(base["path"])
        if not base_path.exists():
            raise CheckpointError(
                f"{path} holds LoRA adapters only, trained on the base {base_path}, which is "
                "not there; put the base back at that path to load them"
            )
        state = _base_state(base_path, bool(base.get("hf")), spec, args)
    elif "seed" in base:  # weights come from (seed, name): made again as the run made them
        state = _seeded_state(spec, args, int(base["seed"]))
    else:
        raise CheckpointError(f"{path} holds LoRA adapters without a record of their base")
    state.update({n: t for n, t in load_dcp_model_state(path).items() if is_adapter(n)})
    settings = SimpleNamespace(
        rank=adapters["rank"],
        alpha=adapters["alpha"],
        dropout=0.0,
        target_modules=adapters["target_modules"],
    )
    model = spec.build_meta(args)
    apply_lora(model, settings)
    return fold(state, [model])


def _seeded_state(spec, args, seed: int) -> dict[str, torch.Tensor]:
    from titan.components.checkpoint.train_state import ModelState

    model = spec.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(seed, buffer_device=torch.device("cpu"))
    return ModelState([model]).state_dict()


def _base_state(path: Path, hf: bool, spec, args) -> dict[str, torch.Tensor]:
    if not hf:
        return load_dcp_model_state(path)
    from titan.components.checkpoint.hf_io import load_hf_into

    meta = spec.build_meta(args)
    empty = {n: torch.empty(t.shape, dtype=t.dtype) for n, t in meta.state_dict().items()}
    state, _ = load_hf_into(empty, path, spec, args)
    return state
