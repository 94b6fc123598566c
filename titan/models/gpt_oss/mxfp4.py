"""The released GPT-OSS checkpoints store each expert matrix in MXFP4 (the OCP microscaling
format): `<name>_blocks` (uint8, (experts, out, in/32, 16): 32 four-bit E2M1 values per block,
two per byte, the low nibble first) and `<name>_scales` (uint8, (experts, out, in/32): each
block's power of two, biased by 127). titan trains in float, so such a folder is dequantized
once, into the hub's float layout (`<name>`, (experts, in, out)), which titan and transformers
both read:

    python -m titan.models.gpt_oss.mxfp4 SRC DST [--dtype bfloat16]

One weight file at a time (memory: the largest file, dequantized); the other files of the
folder (tokenizer, generation config) are copied, and config.json loses its
quantization_config."""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

# E2M1: sign, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = FP4_VALUES + tuple(-v for v in FP4_VALUES)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """(..., rows, groups, 16) uint8 blocks and (..., rows, groups) uint8 scales ->
    (..., rows, groups x 32) values in `dtype`: each value times 2^(scale - 127)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
            "pair: blocks are (..., groups, 16) for scales (..., groups)"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # low nibble first
    # exact in float32: an E2M1 value times a power of two in float32's range
    out = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return out.flatten(-2).to(dtype)


def dequantize_state(tensors: dict[str, torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    """A weight file's tensors with each `X_blocks` / `X_scales` pair replaced by `X` in the
    hub's float layout (experts, in, out); the rest cast to `dtype` when floating point."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALES):
            continue
        if name.endswith(BLOCKS):
            base = name[: -len(BLOCKS)]
            if base + SCALES not in tensors:
                raise ValueError(f"{name} has no {base + SCALES} in the same file")
            out[base] = dequantize(t, tensors[base + SCALES], dtype).transpose(-2, -1).contiguous()
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    orphans = [n for n in tensors if n.endswith(SCALES) and n[: -len(SCALES)] not in out]
    if orphans:
        raise ValueError(f"{orphans[:3]} have no {BLOCKS} tensor in the same file")
    return out


def convert_folder(src: Path, dst: Path, dtype=torch.bfloat16) -> Path:
    """Write DST: SRC's model with every MXFP4 pair dequantized to `dtype`."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} holds no .safetensors files")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty: choose a new folder")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for file in files:
        state = dequantize_state(load_file(str(file)), dtype)
        save_file(state, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, file.name))
        total += sum(t.numel() * t.element_size() for t in state.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for other in src.iterdir():
        skip = other.suffix == ".safetensors" or other.name.startswith("model.safetensors")
        if other.is_file() and not skip and other.name != "config.json":
            shutil.copy2(other, dst / other.name)
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m titan.models.gpt_oss.mxfp4",
        description="Dequantize a GPT-OSS HF folder's MXFP4 expert weights into a float folder",
    )
    p.add_argument("src", type=Path, help="the HF folder with *_blocks / *_scales tensors")
    p.add_argument("dst", type=Path, help="a new folder for the float checkpoint")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    opts = p.parse_args(argv)
    try:
        out = convert_folder(opts.src, opts.dst, getattr(torch, opts.dtype))
    except (OSError, ValueError) as e:
        print(f"mxfp4: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(out)


if __name__ == "__main__":
    main()
