"""Average the weights of checkpoints (the last few of a run: checkpoint averaging, model soups
of one run), tensor by tensor:

    python -m titan.tools.average --checkpoints outputs/checkpoint/step-800 \\
        outputs/checkpoint/step-900 outputs/checkpoint/step-1000 --out averaged [--weights 1 1 2]

--checkpoints are DCP step folders of one model (each checked against its checksums; a
checkpoint root stands for its newest intact step) or HF folders of one model, not a mix.
The output is the same kind: a model-only DCP checkpoint (which checkpoint.initial_load_path,
titan.tools.generate and titan.tools.eval read; its marker records the model and tokenizer of
the first) or an HF folder laid out as the first (its config and tokenizer files copied). Each
tensor is sum(w_i x tensor_i) / sum(w_i), computed in float32 (float64 for float64 tensors)
and stored in the tensor's own dtype; --weights default to equal. Only one tensor's sum and
one saved chunk of an input are in memory at a time. Bad input ends with one line on stderr
and exit code 2; the output folder must be new or empty (--overwrite replaces it).
"""

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch

PROG = "titan.tools.average"


class AverageError(ValueError):
    """Inputs that cannot be averaged: one line for the user, exit 2."""


def _fail(why) -> None:
    print(f"{PROG}: {why}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse(argv):
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--checkpoints", nargs="+", required=True, help="DCP step folders, or HF folders"
    )
    ap.add_argument(
        "--weights", nargs="+", type=float, default=None, help="one per checkpoint (default: equal)"
    )
    ap.add_argument("--out", "--output", dest="out", required=True, help="the folder to write")
    ap.add_argument("--overwrite", action="store_true", help="replace what --out holds")
    return ap.parse_args(argv)


def weights_of(weights: list[float] | None, n: int) -> list[float]:
    """Each checkpoint's share (summing to 1) of the given weights."""
    if weights is None:
        return [1 / n] * n
    if len(weights) != n:
        raise AverageError(f"--weights gives {len(weights)} numbers for {n} checkpoints")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise AverageError(f"--weights {weights}: each must be >= 0, and their sum > 0")
    total = sum(weights)
    return [w / total for w in weights]


def _sum_dtype(dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point:
        raise AverageError(f"a {dtype} tensor cannot be averaged")
    return torch.float64 if dtype == torch.float64 else torch.float32


def _same_tensors(shapes: list[dict], paths: list[Path]) -> dict:
    """The first input's {name: (shape, dtype)}, after checking every other holds the same."""
    first = shapes[0]
    for other, path in zip(shapes[1:], paths[1:]):
        if other.keys() != first.keys():
            diff = sorted(other.keys() ^ first.keys())
            raise AverageError(
                f"{path} and {paths[0]} hold different tensors ({len(diff)} differ, first "
                f"{diff[0]!r}): average checkpoints of one model"
            )
        for name, meta in first.items():
            if other[name] != meta:
                raise AverageError(
                    f"{name} is {other[name][0]} {other[name][1]} in {path} and {meta[0]} "
                    f"{meta[1]} in {paths[0]}: average checkpoints of one model"
                )
    for name, (_, dtype) in first.items():
        try:
            _sum_dtype(dtype)
        except AverageError as e:
            raise AverageError(f"{name}: {e}") from None
    return first


def _out_folder(out: Path) -> None:
    """An empty `out` (what it held is removed: --overwrite was given, or it is empty)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


def average_dcp(paths: list[Path], weights: list[float], out: Path, prepare) -> None:
    from titan.components.checkpoint import folders
    from titan.components.checkpoint.integrity import collect_sidecars, remove_sidecars
    from titan.components.checkpoint.streaming import DCPModelReader, write_dcp_model

    models = [folders.saved_model(p) for p in paths]
    if any(m != models[0] for m in models[1:]):
        i = next(i for i, m in enumerate(models) if m != models[0])
        raise AverageError(
            f"{paths[i]} records another model than {paths[0]} ({models[i]} against "
            f"{models[0]}): average checkpoints of one model"
        )
    readers = [DCPModelReader(p) for p in paths]
    shapes = _same_tensors([r.shapes() for r in readers], paths)

    def averaged(name: str) -> torch.Tensor:
        size, dtype = shapes[name]
        total = torch.zeros(size, dtype=_sum_dtype(dtype))
        for reader, w in zip(readers, weights):
            for where, chunk in reader.chunks(name):
                total[where].add_(chunk, alpha=w)
                del chunk
        return total if total.dtype == dtype else total.to(dtype)

    prepare()  # the inputs checked: now the output folder is emptied
    write_dcp_model(out, shapes, averaged)
    first = folders._marker(paths[0])
    folders.write_complete_marker(
        out,
        step=-1,
        model_only=True,
        model=models[0],
        files=collect_sidecars(out),
        trained_with=first.get("trained_with"),
    )
    remove_sidecars(out)


def average_hf(paths: list[Path], weights: list[float], out: Path, prepare) -> None:
    from titan.components.checkpoint import hf_io
    from titan.components.checkpoint.streaming import (
        read_safetensor,
        safetensors_header,
        safetensors_shapes,
        write_safetensors,
    )

    files = [hf_io.hf_weight_files(p) for p in paths]  # checked: present, whole, checksums
    configs = [_architecture(json.loads((p / hf_io.HF_CONFIG).read_text())) for p in paths]
    for path, config in zip(paths[1:], configs[1:]):
        if config != configs[0]:
            diff = sorted(
                k for k in config.keys() | configs[0].keys() if config.get(k) != configs[0].get(k)
            )
            raise AverageError(
                f"{path}/config.json differs from {paths[0]}'s ({', '.join(diff[:5])}): "
                "average folders of one model"
            )
    headers = {f: safetensors_header(f) for fs in files for f in fs}  # each read once
    where, held = [], []  # per input: {name: its file}, {name: (shape, dtype)}
    for fs in files:
        tensors = {f: safetensors_shapes(headers[f]) for f in fs}
        where.append({n: f for f, names in tensors.items() for n in names})
        held.append({n: meta for names in tensors.values() for n, meta in names.items()})
    shapes = _same_tensors(held, paths)

    def averaged(name: str) -> torch.Tensor:
        size, dtype = shapes[name]
        total = torch.zeros(size, dtype=_sum_dtype(dtype))
        for w_files, w in zip(where, weights):
            file = w_files[name]
            total.add_(read_safetensor(file, name, headers[file]), alpha=w)
        return total if total.dtype == dtype else total.to(dtype)

    prepare()
    for f in files[0]:
        write_safetensors(out / f.name, headers[f], averaged)
    for name in (
        hf_io.HF_CONFIG,
        hf_io.HF_GENERATION_CONFIG,
        hf_io.HF_INDEX_FILE,
        *hf_io.HF_TOKENIZER_FILES,
    ):
        if (paths[0] / name).is_file():
            shutil.copyfile(paths[0] / name, out / name)
    hf_io.write_checksums(out)  # the output holds the first input's weight files only


def main(argv: list[str] | None = None) -> None:
    from titan.components.checkpoint.folders import CheckpointError
    from titan.runtime.paths import is_remote
    from titan.tools.generate import _is_hf, readable_folder

    opts = parse(argv)
    try:
        weights = weights_of(opts.weights, len(opts.checkpoints))
        paths = [readable_folder(c, "--checkpoints") for c in opts.checkpoints]
        if is_remote(opts.out):
            raise AverageError(
                f"--out {opts.out}: the average is written to a local folder; upload it after"
            )
        kinds = {_is_hf(p) for p in paths}
        if len(kinds) > 1:
            raise AverageError(
                "--checkpoints mixes DCP steps and HF folders: average one kind (convert "
                "with scripts/convert_to_hf.py or convert_from_hf.py first)"
            )
        out = Path(opts.out)
        if out.resolve() in {p.resolve() for p in paths}:
            raise AverageError(f"--out {out} is one of the checkpoints")
        if out.exists() and any(out.iterdir()) and not opts.overwrite:
            raise AverageError(
                f"--out {out} exists and is not empty; pass --overwrite to replace it"
            )
        average = average_hf if kinds == {True} else average_dcp
        average(paths, weights, out, lambda: _out_folder(out))
    except (AverageError, CheckpointError) as e:
        _fail(e)
    shares = ", ".join(f"{p} x {w:.4g}" for p, w in zip(paths, weights))
    print(f"{PROG}: wrote {out}: {shares}", flush=True)


if __name__ == "__main__":
    main()


# config.json fields that say nothing of the architecture: how a folder was saved, its token
# ids, the context it was published for
_NOT_ARCHITECTURE = (
    "_name_or_path",
    "architectures",
    "bos_token_id",
    "dtype",
    "eos_token_id",
    "max_position_embeddings",
    "pad_token_id",
    "torch_dtype",
    "transformers_version",
    "use_cache",
)


def _architecture(config: dict) -> dict:
    """What of an HF config two folders must share to be averaged: the model args the titan
    family of its model type reads from it (a base folder and its fine-tune's export, whose
    configs differ in fields titan does not write), else its fields but those above."""
    from titan.components.checkpoint.hf_io import args_from_hf_config, reader_of

    spec = reader_of(config)
    if spec is not None:
        try:
            args = args_from_hf_config(spec, config, max_seq_len=1)
            fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
            return {"family": spec.name, **{k: v for k, v in fields.items() if k != "context_len"}}
        except Exception:  # noqa: BLE001  a config titan cannot read is compared as it is
            pass
    return {k: v for k, v in config.items() if k not in _NOT_ARCHITECTURE}
