"""Export a titan DCP checkpoint to an HF folder (safetensors + config.json), through the
model family's state-dict adapter.

    # one step folder of a training run (full or model-only checkpoint)
    python scripts/convert_to_hf.py outputs/llama3_8b/checkpoint/step-1000 exports/llama3_8b_hf \\
        --flavor 8B --dtype bfloat16 --tokenizer assets/hf/Llama-3.1-8B

    # a checkpoint root: the newest completed step-N folder in it is used
    python scripts/convert_to_hf.py outputs/debug/checkpoint exports/debug_hf --flavor debugmodel

The architecture comes from the registered flavor (--model-name/--flavor, as in the
training config); the vocab size is read from the checkpoint's embedding, and
--max-seq-len becomes max_position_embeddings. Only the `model` entry is read; the
optimizer state is never loaded. Folders without the `.complete` marker are refused.
--tokenizer copies tokenizer.json (given a folder, also tokenizer_config.json,
special_tokens_map.json and generation_config.json when present).
"""

import argparse
import shutil
import sys
import time
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def copy_tokenizer(src: str, out_dir: Path) -> list[str]:
    src_path = Path(src)
    if src_path.is_file():
        shutil.copy2(src_path, out_dir / "tokenizer.json")
        return ["tokenizer.json"]
    if not (src_path / "tokenizer.json").is_file():
        raise SystemExit(f"error: --tokenizer {src!r} is neither a tokenizer.json nor a folder holding one")
    copied = []
    for name in TOKENIZER_FILES:
        if (src_path / name).is_file():
            shutil.copy2(src_path / name, out_dir / name)
            copied.append(name)
    return copied


def vocab_size(state: dict, spec, flavor) -> int:
    """The vocabulary the checkpoint was trained with (the tokenizer's, not the flavor's):
    the one parameter dimension that changes when vocab_size does."""
    from titan.components.checkpoint import CheckpointError

    a, b = (spec.state_shapes(flavor.with_updates(vocab_size=v)) for v in (3, 5))
    for name, shape in a.items():
        for dim, (x, y) in enumerate(zip(shape, b[name])):
            if (x, y) == (3, 5) and name in state:
                return state[name].shape[dim]
    raise CheckpointError("cannot tell the vocabulary size: the checkpoint holds no "
                          "vocabulary-sized parameter")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="DCP step folder (…/checkpoint/step-N) or a checkpoint root")
    ap.add_argument("output", help="HF folder to write (created; old weight files in it are replaced)")
    ap.add_argument("--model-name", default="llama3", help="registered model family (default llama3)")
    ap.add_argument("--flavor", required=True, help="flavor the checkpoint was trained with, e.g. 8B")
    ap.add_argument("--max-seq-len", type=int, default=8192,
                    help="written as max_position_embeddings (default 8192)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the exported weights (default float32)")
    ap.add_argument("--max-shard-size", default="5GB",
                    help="shard the safetensors above this size, e.g. 5GB, 500MB (default 5GB)")
    ap.add_argument("--tokenizer", help="tokenizer.json, or a folder holding it, to copy alongside")
    args = ap.parse_args(argv)

    from titan.components import checkpoint, hf_io
    from titan.models.spec import get_train_spec

    t0 = time.time()
    try:
        spec = get_train_spec(args.model_name)
    except KeyError as e:
        raise SystemExit(f"error: {e.args[0]}") from None
    if args.flavor not in spec.flavors:
        raise SystemExit(f"error: unknown flavor {args.flavor!r} for {args.model_name}; "
                         f"choose from {', '.join(spec.flavors)}")
    if spec.state_dict_adapter is None:
        raise SystemExit(f"error: model family {args.model_name!r} registers no HF state-dict "
                         "adapter, so it cannot be exported to HF")

    ckpt = Path(args.checkpoint)
    if not (ckpt / checkpoint.COMPLETE_MARKER).is_file():
        latest = checkpoint.latest_complete_step(ckpt)
        if latest is not None:
            print(f"using the newest completed checkpoint {latest}")
            ckpt = latest
    try:
        state = checkpoint.load_dcp_model_state(ckpt)
        vocab = vocab_size(state, spec, spec.flavors[args.flavor])
        model_args = spec.flavors[args.flavor].with_updates(vocab_size=vocab, max_seq_len=args.max_seq_len)
        out = hf_io.save_hf(state, spec, model_args, args.output, dtype=args.dtype,
                            max_shard_size=args.max_shard_size)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}") from None
    copied = copy_tokenizer(args.tokenizer, out) if args.tokenizer else []
    n = sum(t.numel() for t in state.values())
    print(f"wrote {out} ({n / 1e6:.1f}M parameters, {args.dtype}, vocab {vocab}"
          f"{', tokenizer: ' + ', '.join(copied) if copied else ''}) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
