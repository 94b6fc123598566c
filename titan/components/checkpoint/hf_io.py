"""Model weights to and from Hugging Face folders, for any model family with a state-dict
adapter (`TrainSpec.state_dict_adapter`): the adapter maps names, layouts and config.json;
this module reads and writes the safetensors files and checks shapes against the model.

Folders: config.json + model.safetensors, or model-0000X-of-0000Y.safetensors shards +
model.safetensors.index.json. Only safetensors are read, never .bin/.pth pickles.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from titan.components.checkpoint.folders import CheckpointError, _quiet_no_dist
from titan.models.spec import ModelArgs, StateDictAdapter, TrainSpec
from titan.runtime.dtypes import dtype_name, to_dtype
from titan.runtime.paths import as_path, local_copy

logger = logging.getLogger(__name__)

HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"
HF_SINGLE_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
# [crc32, size] of each weight file as exported; transformers ignores files it does not know
HF_CHECKSUMS = "titan_checksums.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # HF's "5GB"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
SUFFIX = ".safetensors"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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


def check_state_matches(
    state: dict[str, torch.Tensor],
    spec: TrainSpec,
    args: ModelArgs,
    what: str = "state",
    partial: bool = False,
) -> None:
    """Raise a CheckpointError listing missing / unexpected / mis-shaped parameters.
    `partial`: a pipeline stage's share, so absent names are fine."""
    want = spec.state_shapes(args)
    # a tied weight is one matrix under two names: a titan checkpoint stores only the owner's
    copies = {copy for owner, copy in spec.build_meta(args).tied_parameters() if owner in state}
    missing = [] if partial else sorted(set(want) - set(state) - copies)
    extra = sorted(set(state) - set(want))
    bad = [
        f"{n}: {tuple(state[n].shape)} vs {tuple(want[n])}"
        for n in want
        if n in state and tuple(state[n].shape) != tuple(want[n])
    ]
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
    file = as_path(hf_dir) / HF_CONFIG
    if not file.is_file():
        raise CheckpointError(f"no {HF_CONFIG} in {str(hf_dir)!r}")
    try:
        config = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = f" (line {e.lineno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        raise CheckpointError(
            f"{file} is not valid JSON{where}; fix it or download the model's config.json again"
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{file} holds a JSON {type(config).__name__}, not the object of "
            "an HF config; download the model's config.json again"
        )
    return config


def args_from_hf_config(spec: TrainSpec, config: dict, max_seq_len: int | None = None) -> ModelArgs:
    """The ModelArgs an HF config describes, by the family's adapter."""
    adapter = adapter_class(spec)
    try:
        return adapter.args_from_hf_config(config, max_seq_len)
    except (KeyError, ValueError) as e:
        other = other_family(config, spec)
        if other:
            raise CheckpointError(other) from None
        missing = f"config.json lacks {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(missing) from None


def _readers() -> dict[str, tuple[TrainSpec, tuple[str, ...]]]:
    """Each registered family with an HF adapter: (its spec, the model types it reads)."""
    from titan.models.spec import get_train_spec, registered_names

    specs = [get_train_spec(name) for name in registered_names()]
    return {s.name: (s, s.state_dict_adapter.hf_model_types) for s in specs if s.state_dict_adapter}


def reader_of(config: dict) -> TrainSpec | None:
    """The registered family whose adapter reads an HF config's model_type (None: none)."""
    kind = config.get("model_type")
    return next((spec for spec, kinds in _readers().values() if kind in kinds), None)


def other_family(config: dict, spec: TrainSpec) -> str | None:
    """Where an HF config's model_type is not one `spec`'s family reads: which family reads
    it (model.name to set), or that none does, with the types titan reads; None otherwise."""
    kind = config.get("model_type")
    if not kind or kind in adapter_class(spec).hf_model_types:
        return None
    readers = _readers()
    other = next((spec for spec, kinds in readers.values() if kind in kinds), None)
    if other is not None:
        return (
            f"it holds a {kind!r} model, which titan trains as model.name = {other.name!r}: set it"
        )
    known = "; ".join(f"{name}: {', '.join(kinds)}" for name, (_, kinds) in readers.items())
    return f"it holds a {kind!r} model, which no titan family reads (the types each reads: {known})"


def args_from_hf(hf_dir: str | Path, spec: TrainSpec, max_seq_len: int | None = None) -> ModelArgs:
    """The ModelArgs of an HF folder's config.json, by the family's adapter."""
    return args_from_hf_config(spec, read_hf_config(hf_dir), max_seq_len)


# what an export writes beside the weights: left from an earlier export, a tokenizer would
# disagree with a config.json written without one (no BOS/EOS ids)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def hf_model_files(folder: str | Path) -> list[Path]:
    """The files of an HF model in `folder`: config files, weights (any safetensors), index,
    titan's checksums and tokenizer files; nothing else (a README stays)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = {HF_CONFIG, HF_GENERATION_CONFIG, HF_INDEX_FILE, HF_CHECKSUMS, *HF_TOKENIZER_FILES}
    return sorted(
        p for p in folder.iterdir() if p.is_file() and (p.name in names or p.name.endswith(SUFFIX))
    )


def holds_hf_model(folder: str | Path) -> bool:
    """Whether `folder` already holds an HF model: a config.json, weights or an index."""
    return any(
        p.name in (HF_CONFIG, HF_INDEX_FILE) or p.name.endswith(SUFFIX)
        for p in hf_model_files(folder)
    )


def remove_hf_model(folder: str | Path) -> list[Path]:
    """Delete the files of an HF model in `folder` (see hf_model_files); returns them."""
    files = hf_model_files(folder)
    for f in files:
        f.unlink()
    return files


def _stale_hf_weights(out_dir: Path) -> list[Path]:
    return [
        p
        for p in out_dir.iterdir()
        if p.name in (HF_SINGLE_FILE, HF_INDEX_FILE, HF_CHECKSUMS) or _SHARD_NAME.match(p.name)
    ]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _file_indices(shapes: dict[str, torch.Size], itemsize: int, limit: int) -> dict[str, int]:
    """HF name -> output file number (1..N), filling files in order up to `limit` bytes."""
    out, index, size = {}, 1, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if size and size + nbytes > limit:
            index, size = index + 1, 0
        out[name] = index
        size += nbytes
    return out


def save_hf(
    state_titan: dict[str, torch.Tensor],
    spec: TrainSpec,
    args: ModelArgs,
    out_dir: str | Path,
    dtype: str | torch.dtype = torch.float32,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
    config_extra: dict | None = None,
    source: dict | None = None,
) -> Path:
    """Write an HF folder (config.json and safetensors weights) through the family's adapter.

    `state_titan` is this rank's state dict: full tensors in one process, or the DTensor
    shards / pipeline stages of a parallel run, where every rank must call this. Each rank
    writes only the shards it holds (DCP's HF writer), then the ranks assemble the
    `model-0000X-of-0000Y.safetensors` files between them, a file per rank at a time, so no
    rank ever holds the whole model. One file of at most `max_shard_size` bytes becomes
    `model.safetensors`. Weight files of an earlier export into the same folder are removed
    first; other files (tokenizer, README) are left alone. `config_extra` is merged into
    config.json (e.g. bos/eos token ids); `source`, the config of the HF model the run
    started from, gives the fields titan does not write (`exported_config`).
    """
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    dtype = to_dtype(dtype)
    distributed, rank = _distributed(), _rank()
    adapter = adapter_class(spec)(args)
    whole = spec.state_shapes(args)
    # DTensors report their global shape; a pipeline stage holds only its own layers
    check_state_matches(state_titan, spec, args, "titan state dict", partial=distributed)
    hf = {name: t.detach().to(dtype) for name, t in adapter.to_hf(state_titan).items()}
    all_names = adapter.to_hf({n: torch.empty(s, device="meta") for n, s in whole.items()})
    indices = _file_indices(
        {n: t.shape for n, t in all_names.items()}, dtype.itemsize, parse_size(max_shard_size)
    )

    out_dir = Path(out_dir)
    staging = out_dir / ".sharded"
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for p in _stale_hf_weights(out_dir):
            p.unlink()
        shutil.rmtree(staging, ignore_errors=True)
    if distributed:
        dist.barrier()
    # dcp.save returns on every rank once all ranks' shards are on disk, and the assembly
    # ends with a barrier of its own
    with _quiet_no_dist():
        dcp.save(
            hf,
            storage_writer=HuggingFaceStorageWriter(
                str(staging), fqn_to_index_mapping=indices, save_distributed=True
            ),
        )
        consolidate_safetensors_files_on_every_rank(str(staging), str(out_dir), indices)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        _write_index(out_dir, max(indices.values()))
    write_checksums(out_dir, distributed, rank)
    if rank == 0:
        config = exported_config(source, adapter.hf_config(), args) | (config_extra or {})
        config["torch_dtype"] = dtype_name(dtype)
        (out_dir / HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        if generation:  # HF generation stops at eos_token_id; without it, at HF's default id
            (out_dir / HF_GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n")
    if distributed:  # the folder is whole when any rank returns
        dist.barrier()
    return out_dir


# fields of a source config an export never keeps: how the weights were stored (titan writes
# plain tensors in its own dtype); RoPE's (rope_*) titan writes as it trained them
_NOT_KEPT = ("quantization_config", "dtype", "torch_dtype")


def exported_config(source: dict | None, ours: dict, args: ModelArgs) -> dict:
    """The config.json of an export: titan's fields over those of the HF model the run
    started from (`source`), where that is the same model type, so a fine-tune keeps what
    it did not change (token ids, initializer range, the published context: titan's own
    max_position_embeddings is the training length where the args publish none)."""
    if not source or source.get("model_type") != ours.get("model_type"):
        return ours
    kept = {k: v for k, v in source.items() if k not in _NOT_KEPT and not k.startswith("rope")}
    config = kept | ours
    if args.context_len is None and "max_position_embeddings" in source:
        context = (source["max_position_embeddings"], ours["max_position_embeddings"])
        config["max_position_embeddings"] = max(context)
    return config


def write_checksums(out_dir: Path, distributed: bool = False, rank: int = 0) -> None:
    """The weight files' checksums, read back once the files are whole (DCP's assembly writes
    them): each rank reads its share; rank 0 writes them beside the index."""
    from titan.components.checkpoint.integrity import file_crc32

    if distributed:
        dist.barrier()  # the index (or the single file's rename) is in place
    files = sorted(p.name for p in out_dir.glob(f"*{SUFFIX}"))
    world = dist.get_world_size() if distributed else 1
    mine = {n: [file_crc32(out_dir / n), (out_dir / n).stat().st_size] for n in files[rank::world]}
    parts = [mine]
    if distributed:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    if rank == 0:
        sums = {k: v for part in parts for k, v in part.items()}
        (out_dir / HF_CHECKSUMS).write_text(json.dumps(sums, indent=1) + "\n")


def _header_offsets(file: Path) -> dict[str, tuple[int, int]]:
    """{tensor name: (start, end) byte offsets} from a safetensors header."""
    from titan.components.checkpoint.streaming import safetensors_header

    header = safetensors_header(file)
    return {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


def _write_index(out_dir: Path, n_files: int) -> None:
    """HF's index of a sharded folder, from the files' headers; one file is `model.safetensors`."""
    if n_files == 1:
        (out_dir / f"model-00001-of-00001{SUFFIX}").rename(out_dir / HF_SINGLE_FILE)
        (out_dir / HF_INDEX_FILE).unlink(missing_ok=True)
        return
    weight_map, total = {}, 0
    for i in range(1, n_files + 1):
        name = f"model-{i:05d}-of-{n_files:05d}{SUFFIX}"
        for key, (start, end) in _header_offsets(out_dir / name).items():
            weight_map[key] = name
            total += end - start
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / HF_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def hf_weight_files(hf_dir: Path, verify: str = "fast") -> list[Path]:
    """The folder's weight files, each present and as long as its header says, and (a folder
    titan exported) as long as it was written, or with `verify` "full" the same bytes; a
    CheckpointError naming the file otherwise. "fast" reads the index and the headers only."""
    hf_dir = as_path(hf_dir)
    index = hf_dir / HF_INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index} is not an HF weight index (no readable "
                "weight_map); download or copy the folder again"
            ) from None
        missing = [f for f in files if not (hf_dir / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{HF_INDEX_FILE} in {str(hf_dir)!r} names missing shards "
                f"{missing}; download or copy them again"
            )
        paths = [hf_dir / f for f in files]
    elif (hf_dir / HF_SINGLE_FILE).is_file():
        paths = [hf_dir / HF_SINGLE_FILE]
    else:
        raise CheckpointError(
            f"no {HF_SINGLE_FILE} or {HF_INDEX_FILE} in {str(hf_dir)!r} "
            "(only safetensors weights are read, never .bin/.pth pickles)"
        )
    for path in paths:
        _check_length(path)
    _check_checksums(hf_dir, paths, verify)
    return paths


def _check_checksums(hf_dir: Path, paths: list[Path], verify: str) -> None:
    from titan.components.checkpoint.integrity import file_problem

    sidecar = hf_dir / HF_CHECKSUMS
    if verify == "off" or not sidecar.is_file():
        return  # a folder from the hub, or exported before checksums
    try:
        sums = json.loads(sidecar.read_text())
    except ValueError:
        raise CheckpointError(f"{sidecar} is unreadable; export the folder again") from None
    for path in paths:
        if path.name in sums:
            why = file_problem(hf_dir, path.name, sums[path.name], full=verify == "full")
            if why:
                raise CheckpointError(f"{hf_dir}: {why}; export or copy the folder again")


def _check_length(file: Path) -> None:
    """An interrupted download leaves a file shorter than its header's offsets: caught here,
    before any rank maps it and fails somewhere inside DCP."""
    have = file.stat().st_size
    try:
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if 8 + n > have:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        end = max(
            (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        raise CheckpointError(
            f"{file} is not a safetensors file (its header is cut off or "
            "unreadable); download or copy it again"
        ) from None
    if have < 8 + n + end:
        raise CheckpointError(
            f"{file} is truncated ({have} of {8 + n + end} bytes): download or copy it again"
        )


def load_hf_state(
    hf_dir: str | Path, dtype: str | torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The raw HF-named tensors of a folder (safetensors only), optionally cast."""
    from safetensors import safe_open

    out = {}
    for file in hf_weight_files(Path(hf_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                out[name] = f.get_tensor(name)
    if dtype is not None:
        dtype = to_dtype(dtype)
        out = {k: v.to(dtype) for k, v in out.items()}
    return out


class _HFReader(HuggingFaceStorageReader):
    """DCP's HF safetensors reader, restricted to the weight files the folder's index names
    (repos may hold others, e.g. Mistral's consolidated.safetensors), and counting the bytes
    this rank reads."""

    def __init__(self, hf_dir: Path):
        super().__init__(str(hf_dir))
        # by name: a store's listing names its objects without the URL's scheme
        self.files = {f.name for f in hf_weight_files(hf_dir)}
        self.bytes_read = 0
        listing = self.fs.ls
        self.fs.ls = lambda path: [
            f for f in listing(path) if str(f).rstrip("/").rsplit("/", 1)[-1] in self.files
        ]

    def _process_read_request(self, f, req, planner):
        itemsize = self.storage_data[req.storage_index].dtype.itemsize
        self.bytes_read += math.prod(req.lengths) * itemsize
        super()._process_read_request(f, req, planner)


def local_hf_copy(hf_dir: Path) -> Path:
    """An HF folder in object storage, copied once into the local cache (keyed by its URL and
    its files' names and sizes): DCP's HF reader reads local files (safetensors maps them)."""
    import hashlib

    files = hf_weight_files(hf_dir)  # present, whole, and as the export wrote them
    names = (HF_CONFIG, HF_GENERATION_CONFIG, HF_INDEX_FILE, HF_CHECKSUMS, *HF_TOKENIZER_FILES)
    files += [hf_dir / n for n in names if (hf_dir / n).is_file()]
    listing = sorted((f.name, f.stat().st_size) for f in files)
    key = hashlib.sha256(f"{hf_dir}|{listing}".encode()).hexdigest()[:20]
    return local_copy(files, f"hf-{key}")


def hf_file_shapes(hf_dir: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{HF name: (shape, dtype)} of a folder's weights, from the safetensors headers only."""
    md = _HFReader(as_path(hf_dir)).read_metadata().state_dict_metadata
    return {name: (m.size, m.properties.dtype) for name, m in md.items()}


def load_hf_into(
    state_titan: dict[str, torch.Tensor],
    hf_dir: str | Path,
    spec: TrainSpec,
    args: ModelArgs,
    hf_config: dict | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Fill a titan state dict from an HF folder through DCP; returns (titan state, bytes read).

    `state_titan` holds this rank's tensors: full ones in one process, or the DTensor shards /
    pipeline stages of a parallel run (every rank calls this). Each rank reads from the files
    only the slices its tensors hold, converted to their dtype. The folder is checked against
    the model by its headers before any weight is read.
    """
    hf_dir = as_path(hf_dir)
    config = hf_config if hf_config is not None else read_hf_config(hf_dir)
    adapter = adapter_class(spec)(args)
    reader = _HFReader(hf_dir)
    stored = reader.read_metadata().state_dict_metadata
    file_name = adapter.follow_files(stored)  # a wrapped decoder's names, as to_hf's
    left = len(stored) - len(file_name)
    if left and _rank() == 0:
        logger.info(
            "%s: %d tensors beside the decoder (%s) left unread: titan trains its language model",
            hf_dir,
            left,
            ", ".join(adapter.foreign_prefixes),
        )
    files = {name: (stored[f].size, stored[f].properties.dtype) for name, f in file_name.items()}
    odd = sorted(f"{n} ({d})" for n, (_, d) in files.items() if d not in _FLOAT_DTYPES)
    if odd:
        raise CheckpointError(
            f"HF weights in {str(hf_dir)!r} are stored as {odd[:3]}: titan "
            "reads float32/bfloat16/float16/float64 weights only (dequantize "
            "the model first)"
        )
    try:  # names, layouts and shapes, on meta tensors: no weight is read yet
        planned = adapter.from_hf(
            {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in files.items()},
            hf_config=config,
        )
    except KeyError as e:  # a tensor the family has no name for
        raise CheckpointError(f"HF weights in {str(hf_dir)!r}: {e.args[0]}") from None
    check_state_matches(planned, spec, args, f"HF weights in {str(hf_dir)!r}")

    targets = {n: t for n, t in adapter.to_hf(state_titan).items() if n in files}
    with _quiet_no_dist():
        dcp.load({file_name[n]: t for n, t in targets.items()}, storage_reader=reader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the meta pass above already warned
        state = adapter.from_hf(targets, hf_config=config)
    return state, reader.bytes_read


def load_hf(
    hf_dir: str | Path,
    spec: TrainSpec,
    dtype: str | torch.dtype | None = None,
    args: ModelArgs | None = None,
) -> dict[str, torch.Tensor]:
    """An HF folder as a full titan state dict (titan names and layouts), in one process.

    `args` default: what the adapter reads from config.json. `dtype` casts; None keeps the
    file's.
    """
    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir)
    args = args or args_from_hf_config(spec, config)
    files = hf_file_shapes(hf_dir)
    file_dtype = next(iter(files.values()))[1] if files else torch.float32
    target = to_dtype(dtype) if dtype is not None else file_dtype
    empty = {n: torch.empty(s, dtype=target) for n, s in spec.state_shapes(args).items()}
    state, _ = load_hf_into(empty, hf_dir, spec, args, config)
    return state


class HFModelIO:
    """HF folder I/O for one model, as the checkpointer uses it: every rank passes its own
    shards. `tokenizer` (anything with `save_hf(folder) -> config entries`) is written
    alongside each save, with its BOS/EOS ids in config.json and generation_config.json."""

    def __init__(
        self,
        spec: TrainSpec,
        args: ModelArgs,
        tokenizer=None,
        source: dict | None = None,
        processor=None,
    ):
        """`source`: the config.json of the HF model the run started from, whose fields an
        export keeps where it does not change them (`exported_config`); `processor`: the
        image rule a vision-language model trained with, written as its
        preprocessor_config.json."""
        self.spec, self.args, self.tokenizer, self.source = spec, args, tokenizer, source
        self.processor = processor

    def load_into(self, state: dict[str, torch.Tensor], hf_dir: Path) -> tuple[dict, int]:
        return load_hf_into(state, hf_dir, self.spec, self.args)

    def save(
        self,
        state: dict[str, torch.Tensor],
        out_dir: Path,
        dtype: torch.dtype,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        extra = {}
        if self.tokenizer is not None and _rank() == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            extra = self.tokenizer.save_hf(out_dir)
        if self.processor is not None and _rank() == 0:
            from titan.components.data.image_text import write_processor

            Path(out_dir).mkdir(parents=True, exist_ok=True)
            write_processor(out_dir, self.processor)
        return save_hf(
            state,
            self.spec,
            self.args,
            out_dir,
            dtype,
            max_shard_size,
            config_extra=extra,
            source=self.source,
        )
