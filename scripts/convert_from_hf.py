"""Convert an HF folder (config.json + safetensors) to a model-only titan DCP checkpoint,
through the model family's state-dict adapter: the family whose adapter reads config.json's
model_type (llama, qwen3, ...), or --model-name.

    python scripts/download_hf_assets.py --repo meta-llama/Llama-3.1-8B --weights
    python scripts/convert_from_hf.py assets/hf/Llama-3.1-8B assets/dcp/llama3_8b

then start training from it with

    [checkpoint]
    initial_load_path = "assets/dcp/llama3_8b"

and the training config's model.flavor set to the flavor this script reports (it checks
the HF config against titan's registered flavors), model.tokenizer_path to the HF folder.

Only safetensors are read (never .bin pickles), through DCP's HF storage reader. Started
by torchrun with N processes, each reads and writes 1/N of every tensor, so no process holds
the model (a 70B model in fp32 is 280 GB):

    torchrun --standalone --nproc_per_node 8 scripts/convert_from_hf.py HF_DIR OUT

Training can also start from the HF folder directly (checkpoint.initial_load_in_hf). Bad
input ends with one line on stderr and exit code 2.
Weights are stored as --dtype (default float32, titan's master-weight dtype). Tied embeddings
(Llama 3.2 1B/3B) are untied: the output layer starts as a copy of the embedding, with a
warning. Unsupported configs
(biases, non-llama3 RoPE scaling, head_dim != hidden/heads, ...) are refused.
"""

import argparse
import os
import sys
import time

import torch


def fail(why) -> None:
    """Bad input (a folder, a config, a flag): one line, exit 2, as every titan tool."""
    print(f"convert_from_hf: error: {why}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("hf_dir", help="HF model folder holding config.json and *.safetensors")
    ap.add_argument("output", help="DCP folder to write (gets the .complete marker when done)")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the stored weights (default float32)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    ap.add_argument(
        "--model-name",
        help="registered model family (default: the one that reads config.json's model_type)",
    )
    args = ap.parse_args(argv)

    from titan.components.checkpoint import folders as checkpoint
    from titan.components.checkpoint import hf_io
    from titan.components.checkpoint.identity import model_identity
    from titan.models.spec import family_of_hf_config, get_train_spec, registered_names
    from titan.runtime.dtypes import to_dtype

    t0 = time.time()
    mesh = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: each rank a 1/N slice
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank0 = mesh is None or mesh.get_rank() == 0
    try:
        name = args.model_name or family_of_hf_config(hf_io.read_hf_config(args.hf_dir))
        if name is None:
            raise KeyError(
                f"no registered model family reads model_type "
                f"{hf_io.read_hf_config(args.hf_dir).get('model_type')!r} of "
                f"{args.hf_dir}/config.json; registered: "
                f"{', '.join(registered_names())} (--model-name)"
            )
        spec = get_train_spec(name)
    except checkpoint.CheckpointError as e:
        fail(e)
    except KeyError as e:
        fail(e.args[0])
    try:
        model_args = hf_io.args_from_hf(args.hf_dir, spec)
        shapes = spec.state_shapes(model_args)
        if mesh is None:
            empty = {n: torch.empty(s, dtype=to_dtype(args.dtype)) for n, s in shapes.items()}
        else:  # row slices: DTensors sharded over the processes
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor import empty as dtensor_empty

            empty = {
                n: dtensor_empty(
                    s, dtype=to_dtype(args.dtype), device_mesh=mesh, placements=[Shard(0)]
                )
                for n, s in shapes.items()
            }
        state, nbytes = hf_io.load_hf_into(empty, args.hf_dir, spec, model_args)
        record = model_identity(
            spec, spec.matching_flavor(model_args) or "from_hf", model_args
        ).record()
        out = checkpoint.save_dcp_model_state(
            state, args.output, overwrite=args.overwrite, model=record
        )
    except (checkpoint.CheckpointError, OSError, ValueError) as e:
        fail(e)

    flavor = spec.matching_flavor(model_args)
    n = model_args.num_params()
    if mesh is not None:
        print(f"rank {mesh.get_rank()}: read {nbytes / 2**20:.1f} MiB")
    if not rank0:
        return
    print(f"wrote {out} ({n / 1e6:.1f}M parameters, {args.dtype}) in {time.time() - t0:.1f}s")
    if flavor is not None:
        print(
            f"matches titan flavor '{flavor}' (vocab_size {model_args.vocab_size}): "
            f'set model.flavor = "{flavor}"'
        )
    else:
        print(
            f"warning: no registered flavor has this architecture ({model_args}); train "
            f'it from the HF folder itself: model.flavor = "from_hf", '
            f'checkpoint.initial_load_path = "{args.hf_dir}", '
            "checkpoint.initial_load_in_hf = true",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
