"""Convert an HF folder (config.json + safetensors) to a model-only titan DCP checkpoint,
through the model family's state-dict adapter (--model-name, default llama3).

    python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --weights
    python scripts/convert_from_hf.py assets/hf/Llama-3.1-8B assets/dcp/llama3_8b

then start training from it with

    [checkpoint]
    initial_load_path = "assets/dcp/llama3_8b"

and the training config's model.flavor set to the flavor this script reports (it checks
the HF config against titan's registered flavors), model.tokenizer_path to the HF folder.

Only safetensors are read (never .bin pickles), through DCP's HF storage reader, in one
process: it holds the whole model. To start training from HF weights without that, point
checkpoint.initial_load_path at the HF folder with checkpoint.initial_load_in_hf = true:
there each rank reads only its own shards. Weights are stored as --dtype (default float32,
titan's master-weight dtype). Tied embeddings (Llama 3.2 1B/3B) are untied: the
output layer starts as a copy of the embedding, with a warning. Unsupported configs
(biases, non-llama3 RoPE scaling, head_dim != hidden/heads, ...) are refused.
"""

import argparse
import sys
import time
import warnings


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", help="HF model folder holding config.json and *.safetensors")
    ap.add_argument("output", help="DCP folder to write (gets the .complete marker when done)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the stored weights (default float32)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    ap.add_argument("--model-name", default="llama3", help="registered model family (default llama3)")
    args = ap.parse_args(argv)

    from titan.components import checkpoint, hf_io
    from titan.models.spec import get_train_spec

    t0 = time.time()
    try:
        spec = get_train_spec(args.model_name)
    except KeyError as e:
        raise SystemExit(f"error: {e.args[0]}") from None
    try:
        model_args = hf_io.args_from_hf(args.hf_dir, spec)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = hf_io.load_hf(args.hf_dir, spec, dtype=args.dtype, args=model_args)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        out = checkpoint.save_dcp_model_state(state, args.output, overwrite=args.overwrite)
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}") from None

    flavor = spec.matching_flavor(model_args)
    n = sum(t.numel() for t in state.values())
    print(f"wrote {out} ({n / 1e6:.1f}M parameters, {args.dtype}) in {time.time() - t0:.1f}s")
    if flavor is not None:
        print(f"matches titan flavor '{flavor}' (vocab_size {model_args.vocab_size}): "
              f"set model.flavor = \"{flavor}\"")
    else:
        print(f"warning: no registered flavor has this architecture ({model_args}); train "
              f"it from the HF folder itself: model.flavor = \"from_hf\", "
              f"checkpoint.initial_load_path = \"{args.hf_dir}\", "
              "checkpoint.initial_load_in_hf = true", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
