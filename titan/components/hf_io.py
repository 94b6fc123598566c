"""Model weights to and from Hugging Face folders, for any model family with a state-dict
adapter (`TrainSpec.state_dict_adapter`): the adapter maps names, layouts and config.json;
this module reads and writes the safetensors files and checks shapes against the model.

Folders: config.json + model.safetensors, or model-0000X-of-0000Y.safetensors shards +
model.safetensors.index.json. Only safetensors are read, never .bin/.pth pickles.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from titan.components.checkpoint import CheckpointError
from titan.dtypes import dtype_name, to_dtype
from titan.models.spec import ModelArgs, StateDictAdapter, TrainSpec

HF_CONFIG = "config.json"
HF_SINGLE_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # HF's "5GB"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def adapter_class(spec: TrainSpec) -> type[StateDictAdapter]:
    if spec.state_dict_adapter is None:
        raise CheckpointError(f"model family {spec.name!r} registers no HF state-dict adapter")
    return spec.state_dict_adapter


def parse_size(size: int | str) -> int:
    """'5GB' / '500MB' / '2GiB' / 12345 -> bytes (decimal units as HF uses them)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if m is None:
        raise ValueError(f"cannot parse size {size!r}; e.g. 5GB, 500MB, 1048576")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    return int(float(m.group(1)) * base**power)


def check_state_matches(state: dict[str, torch.Tensor], spec: TrainSpec, args: ModelArgs,
                        what: str = "state") -> None:
    """Raise a CheckpointError listing missing / unexpected / mis-shaped parameters."""
    want = spec.state_shapes(args)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    bad = [f"{n}: {tuple(state[n].shape)} vs {tuple(want[n])}" for n in want
           if n in state and tuple(state[n].shape) != tuple(want[n])]
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}")
        if bad:
            parts.append(f"shape mismatch (have vs expected) {bad[:5]}")
        raise CheckpointError(f"{what} does not fit {args}: " + "; ".join(parts))


def read_hf_config(hf_dir: str | Path) -> dict:
    file = Path(hf_dir) / HF_CONFIG
    if not file.is_file():
        raise CheckpointError(f"no {HF_CONFIG} in {str(hf_dir)!r}")
    return json.loads(file.read_text())


def args_from_hf_config(spec: TrainSpec, config: dict,
                        max_seq_len: int | None = None) -> ModelArgs:
    """The ModelArgs an HF config describes, by the family's adapter."""
    try:
        return adapter_class(spec).args_from_hf_config(config, max_seq_len)
    except (KeyError, ValueError) as e:
        missing = f"config.json lacks {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(missing) from None


def args_from_hf(hf_dir: str | Path, spec: TrainSpec, max_seq_len: int | None = None) -> ModelArgs:
    """The ModelArgs of an HF folder's config.json, by the family's adapter."""
    return args_from_hf_config(spec, read_hf_config(hf_dir), max_seq_len)


def _stale_hf_weights(out_dir: Path) -> list[Path]:
    return [p for p in out_dir.iterdir()
            if p.name in (HF_SINGLE_FILE, HF_INDEX_FILE) or _SHARD_NAME.match(p.name)]


def save_hf(state_titan: dict[str, torch.Tensor], spec: TrainSpec, args: ModelArgs,
            out_dir: str | Path, dtype: str | torch.dtype = torch.float32,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write an HF folder (config.json and safetensors weights) through the family's adapter.

    One `model.safetensors` when everything fits in `max_shard_size` bytes, else
    `model-0000X-of-0000Y.safetensors` shards plus `model.safetensors.index.json`.
    Weight files from an earlier export into the same folder are removed first; other
    files (tokenizer, README) are left alone.
    """
    from safetensors.torch import save_file

    dtype = to_dtype(dtype)
    limit = parse_size(max_shard_size)
    check_state_matches(state_titan, spec, args, "titan state dict")
    adapter = adapter_class(spec)(args)
    hf = {name: t.detach().to("cpu", dtype).contiguous() for name, t in adapter.to_hf(state_titan).items()}

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in _stale_hf_weights(out_dir):
        p.unlink()
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / HF_SINGLE_FILE), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in hf.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    config = adapter.hf_config()
    config["torch_dtype"] = dtype_name(dtype)
    (out_dir / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def _hf_weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / HF_INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{HF_INDEX_FILE} in {str(hf_dir)!r} names missing shards {missing}")
        return [hf_dir / f for f in files]
    if (hf_dir / HF_SINGLE_FILE).is_file():
        return [hf_dir / HF_SINGLE_FILE]
    raise CheckpointError(f"no {HF_SINGLE_FILE} or {HF_INDEX_FILE} in {str(hf_dir)!r} "
                          "(only safetensors weights are read, never .bin/.pth pickles)")


def load_hf_state(hf_dir: str | Path, dtype: str | torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The raw HF-named tensors of a folder (safetensors only), optionally cast."""
    from safetensors import safe_open

    out = {}
    for file in _hf_weight_files(Path(hf_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                out[name] = f.get_tensor(name)
    if dtype is not None:
        dtype = to_dtype(dtype)
        out = {k: v.to(dtype) for k, v in out.items()}
    return out


def load_hf(hf_dir: str | Path, spec: TrainSpec, dtype: str | torch.dtype | None = None,
            args: ModelArgs | None = None) -> dict[str, torch.Tensor]:
    """An HF folder as a titan state dict (titan names and layouts), checked against the model.

    `args` default: what the adapter reads from config.json. `dtype` casts; None keeps the
    file's.
    """
    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir)
    args = args or args_from_hf_config(spec, config)
    try:
        state = adapter_class(spec)(args).from_hf(load_hf_state(hf_dir, dtype), hf_config=config)
    except KeyError as e:  # a tensor the family has no name for
        raise CheckpointError(f"HF weights in {str(hf_dir)!r}: {e.args[0]}") from None
    check_state_matches(state, spec, args, f"HF weights in {str(hf_dir)!r}")
    return state
