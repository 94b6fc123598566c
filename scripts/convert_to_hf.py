"""Export a titan DCP checkpoint to an HF folder (safetensors + config.json), through the
model family's state-dict adapter.

    # one step folder of a training run (full or model-only checkpoint)
    python scripts/convert_to_hf.py outputs/llama3_8b/checkpoint/step-1000 exports/llama3_8b_hf \\
        --flavor 8B --dtype bfloat16 --tokenizer assets/hf/Llama-3.1-8B

    # a checkpoint root: the newest completed step-N folder in it is used
    python scripts/convert_to_hf.py outputs/checkpoint exports/debug_hf --flavor debugmodel

    # an architecture no flavor describes, from a checkpoint saved before titan recorded its
    # model: take it from the HF config.json it started from
    python scripts/convert_to_hf.py outputs/run/checkpoint exports/run_hf \
        --hf-config hf_in/config.json

The family and architecture are the ones the checkpoint records (every save since the record
was added: any family, any flavor, from_hf's too); --model-name/--flavor (as in the training
config) or an HF config.json (--hf-config) name them for older saves, or override. The vocab
size is read from the checkpoint's embedding. max_position_embeddings is the flavor's
published context (131072 for Llama 3.1/3.2), else --max-seq-len. Only the `model` entry is
read; the optimizer state is never loaded. Folders without the `.complete` marker are
refused. The tokenizer the checkpoint records its run trained with (or --tokenizer) writes
tokenizer.json (adding BOS as titan does), tokenizer_config.json and
special_tokens_map.json, and puts the BOS/EOS ids in config.json and
generation_config.json, so HF generation stops where titan's does.

An output folder that already holds an HF model (config.json, safetensors, index) is refused
unless --overwrite, which deletes that model's files (config, weights, index, tokenizer; other
files stay) once the checkpoint has been read, so no stale tokenizer is left beside a
config.json without its BOS/EOS ids. Bad input ends with one line on stderr and exit code 2.
"""

import argparse
import json
import sys
import time
from pathlib import Path


def fail(why) -> None:
    print(f"convert_to_hf: error: {why}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python scripts/convert_to_hf.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("checkpoint", help="DCP step folder (…/checkpoint/step-N) or a checkpoint root")
    ap.add_argument(
        "output", help="HF folder to write (created; one holding an HF model needs --overwrite)"
    )
    ap.add_argument(
        "--model-name",
        help="registered model family (default: the one the checkpoint records, else llama3)",
    )
    arch = ap.add_mutually_exclusive_group()
    arch.add_argument("--flavor", help="flavor the checkpoint was trained with, e.g. 8B")
    arch.add_argument(
        "--hf-config",
        help="an HF config.json with the checkpoint's architecture "
        '(for models trained with model.flavor = "from_hf")',
    )
    ap.add_argument(
        "--max-seq-len",
        type=int,
        default=8192,
        help="max_position_embeddings when the flavor publishes no context (default 8192)",
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the exported weights (default float32)",
    )
    ap.add_argument(
        "--max-shard-size",
        default="5GB",
        help="shard the safetensors above this size, e.g. 5GB, 500MB (default 5GB)",
    )
    ap.add_argument(
        "--tokenizer", help="tokenizer.json, or a folder holding it, to write alongside"
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the HF model already in the output folder (its config, "
        "weights, index and tokenizer files)",
    )
    args = ap.parse_args(argv)

    from titan.components.checkpoint import folders as checkpoint
    from titan.components.checkpoint import hf_io
    from titan.components.checkpoint.identity import args_in_record
    from titan.components.data.tokenizer import Tokenizer, TokenizerError
    from titan.components.lora.merged import adapters_of, merged_state
    from titan.models.spec import get_train_spec

    t0 = time.time()
    from titan.runtime.paths import as_path

    given = as_path(args.checkpoint)  # a folder, or a URL of one in object storage
    try:
        ckpt = checkpoint.intact_folder(
            given,
            "checkpoint",
            "converting",
            lambda m: print(f"convert_to_hf: warning: {m}", file=sys.stderr, flush=True),
        )
    except checkpoint.CheckpointError as e:
        fail(e)
    if ckpt != given:
        print(f"using the newest intact checkpoint {ckpt}")
    record = checkpoint.saved_model(ckpt) if (ckpt / checkpoint.COMPLETE_MARKER).is_file() else None
    name = args.model_name or (record or {}).get("family") or "llama3"
    try:
        spec = get_train_spec(name)
    except KeyError as e:
        fail(e.args[0])
    if args.flavor is not None and args.flavor not in spec.flavors:
        fail(
            f"unknown flavor {args.flavor!r} for {name}; "
            f"choose from {', '.join(spec.flavors)}, or give --hf-config"
        )
    recorded = record is not None and record.get("family") == spec.name
    saved_flavor = (record or {}).get("flavor") if recorded else None
    if args.flavor is not None and saved_flavor in spec.flavors and saved_flavor != args.flavor:
        fail(
            f"{ckpt} holds a {name} {saved_flavor} model, not {args.flavor}: drop --flavor (the "
            "checkpoint records its model) or give --flavor " + saved_flavor
        )
    if args.flavor is None and args.hf_config is None and not recorded:
        fail(
            f"{ckpt} does not record a {name} model (saved before titan recorded it, or of "
            "another family): give --flavor (and --model-name) or --hf-config"
        )
    if spec.state_dict_adapter is None:
        fail(
            f"model family {name!r} registers no HF state-dict adapter, so it "
            "cannot be exported to HF"
        )
    out_dir = Path(args.output)
    if hf_io.holds_hf_model(out_dir) and not args.overwrite:
        fail(
            f"{out_dir} already holds an HF model "
            f"({', '.join(p.name for p in hf_io.hf_model_files(out_dir)[:4])}); pass "
            "--overwrite to replace it, or choose another output folder"
        )
    from titan.components.checkpoint.trained_with import saved_trained_with

    # the tokenizer the run trained with, as its checkpoint records it, unless one is given
    saved_tokenizer = (saved_trained_with(ckpt).get("tokenizer") or {}).get("path")
    tokenizer = None
    try:
        if args.tokenizer:
            tokenizer = Tokenizer(args.tokenizer)
        elif saved_tokenizer and Path(saved_tokenizer).exists():
            tokenizer = Tokenizer(saved_tokenizer)
        elif saved_tokenizer:
            print(
                f"convert_to_hf: warning: {ckpt} was trained with the tokenizer "
                f"{saved_tokenizer}, which is not there: the export has none (pass it with "
                "--tokenizer)",
                file=sys.stderr,
                flush=True,
            )
    except TokenizerError as e:
        fail(f"--tokenizer: {e}" if args.tokenizer else f"the tokenizer {saved_tokenizer}: {e}")
    try:
        if args.hf_config:
            config = json.loads(Path(args.hf_config).read_text())
            base = hf_io.args_from_hf_config(spec, config, args.max_seq_len)
        elif args.flavor is not None:
            base = spec.flavors[args.flavor].with_updates(max_seq_len=args.max_seq_len)
        else:
            base = args_in_record(spec, record, args.max_seq_len)
        adapters = adapters_of(record)
        # a LoRA run's training save holds adapters only: its base with them folded in
        state = (
            merged_state(ckpt, spec, base, adapters)
            if adapters
            else checkpoint.load_dcp_model_state(ckpt)
        )
        vocab = spec.vocab_size_of({n: t.shape for n, t in state.items()}, base)
        model_args = base.with_updates(vocab_size=vocab)
        if args.overwrite:  # only now: a checkpoint that fails to read leaves the old export
            removed = hf_io.remove_hf_model(out_dir)
            if removed:
                print(f"removed the earlier export in {out_dir} ({len(removed)} files)")
        out = hf_io.HFModelIO(spec, model_args, tokenizer).save(
            state, out_dir, args.dtype, args.max_shard_size
        )
    except (checkpoint.CheckpointError, OSError, ValueError) as e:
        fail(e)
    n = sum(t.numel() for t in state.values())
    print(
        f"wrote {out} ({n / 1e6:.1f}M parameters, {args.dtype}, vocab {vocab}"
        f"{', tokenizer ' + str(tokenizer.path) if tokenizer else ''}) in {time.time() - t0:.1f}s"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
