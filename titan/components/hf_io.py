"""Model weights in and out of titan: DCP checkpoint folders and HF safetensors folders.

titan checkpoints are DCP folders (`<dump_folder>/checkpoint/step-N/`) whose state dict is
nested, `{"model": {<titan name>: tensor}, "optimizer": ..., ...}`; DCP flattens it, so the
weights are stored under `model.<titan name>`. A model-only export holds just `"model"`.
A folder is complete once it holds the `.complete` marker, written after `dcp.save`
returns; everything here refuses folders without it.

Everything runs in one process without a process group (DCP's `no_dist=True`), also when
called from inside a distributed job. Nothing here unpickles checkpoint data: tensors come
from DCP's reader or from `safetensors`; DCP reads its own `.metadata` file itself.

HF side: `LlamaForCausalLM` folders (config.json + model.safetensors, or
model-0000X-of-0000Y.safetensors shards + model.safetensors.index.json). titan's output
projection is untied from the embedding; HF configs with `tie_word_embeddings: true`
(e.g. Llama 3.2 1B/3B) are loaded by *untying*: lm_head becomes a copy of embed_tokens,
with a warning, and from then on the two train independently. Exports always write an
untied model (`tie_word_embeddings: false`, an explicit lm_head.weight).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from pathlib import Path

import torch

from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

COMPLETE_MARKER = ".complete"
MODEL_KEY = "model"
HF_CONFIG = "config.json"
HF_SINGLE_FILE = "model.safetensors"
HF_INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # HF's "5GB"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# wrapper fragments torch.compile / activation checkpointing / FSDP1 can leave in names
_WRAPPER_FRAGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


class CheckpointError(RuntimeError):
    """A checkpoint / HF folder that cannot be read or does not fit the model."""


# ----------------------------------------------------------------------------- helpers


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


@contextlib.contextmanager
def _quiet_no_dist():
    """DCP warns on every no_dist call that it assumes single-process use; we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process.*")
        yield


def _canonical(name: str) -> str:
    for frag in _WRAPPER_FRAGMENTS:
        name = name.replace(frag, "")
    return name


def check_complete(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder {str(path)!r} does not exist")
    if not (path / COMPLETE_MARKER).is_file():
        hint = ""
        steps = _step_dirs(path)
        if steps:
            hint = (f"; it looks like a checkpoint root holding {', '.join(p.name for _, p in steps[-3:])}"
                    " - pass one step-N folder")
        raise CheckpointError(
            f"{str(path)!r} is not a completed checkpoint: no {COMPLETE_MARKER} marker (the save "
            f"was interrupted, is still running, or this is not a step folder){hint}"
        )
    return path


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    out = []
    for p in root.glob("step-*"):
        m = re.fullmatch(r"step-(\d+)", p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_complete_step(root: str | Path) -> Path | None:
    """The highest `step-N` folder under `root` that holds the `.complete` marker."""
    for _, p in reversed(_step_dirs(Path(root))):
        if (p / COMPLETE_MARKER).is_file():
            return p
    return None


# ----------------------------------------------------------------------------- DCP


def dcp_model_metadata(path: str | Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{titan name: (global shape, dtype)} of the `model` entry of a DCP checkpoint folder."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = check_complete(path)
    md = FileSystemReader(str(path)).read_metadata()
    planner_data = md.planner_data if isinstance(md.planner_data, dict) else {}
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, meta in md.state_dict_metadata.items():
        fqn = planner_data.get(key)
        if fqn is not None:  # (top-level key, name): DCP keeps the nesting here
            if len(fqn) != 2 or fqn[0] != MODEL_KEY:
                continue
            name = fqn[1]
        elif key.startswith(MODEL_KEY + "."):
            name = key[len(MODEL_KEY) + 1:]
        else:
            continue
        if not isinstance(meta, TensorStorageMetadata):
            continue  # non-tensor model extras (none in titan); nothing to convert
        out[name] = (meta.size, meta.properties.dtype)
    if not out:
        sample = ", ".join(sorted(md.state_dict_metadata)[:5])
        raise CheckpointError(
            f"{str(path)!r} holds no '{MODEL_KEY}.*' tensors (first keys: {sample}); titan "
            f"checkpoints nest the weights under '{MODEL_KEY}'"
        )
    return out


def load_dcp_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of a DCP checkpoint's `model` entry, by titan name.

    Works on full training checkpoints (the optimizer etc. are not read) and model-only
    exports, whatever sharding they were saved with; no process group needed.
    """
    import torch.distributed.checkpoint as dcp

    meta = dcp_model_metadata(path)
    state = {name: torch.empty(size, dtype=dtype, device="cpu") for name, (size, dtype) in meta.items()}
    with _quiet_no_dist():
        dcp.load({MODEL_KEY: state}, checkpoint_id=str(path), no_dist=True)
    return {_canonical(name): t for name, t in state.items()}


def save_dcp_model_state(state: dict[str, torch.Tensor], path: str | Path,
                         overwrite: bool = False) -> Path:
    """Write a model-only DCP checkpoint `{"model": state}` and its `.complete` marker.

    The result is what `checkpoint.initial_load_path` (and `last_save_model_only`) expect.
    Single process, no process group; call it from one rank only.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise CheckpointError(f"{str(path)!r} exists and is not empty; pass overwrite=True "
                                  "(--overwrite) to replace it")
        (path / COMPLETE_MARKER).unlink(missing_ok=True)  # incomplete while rewriting
        for old in [path / ".metadata", *path.glob("*.distcp")]:
            old.unlink(missing_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    with _quiet_no_dist():
        dcp.save({MODEL_KEY: tensors}, checkpoint_id=str(path), no_dist=True)
    (path / COMPLETE_MARKER).write_text("")
    return path


# ----------------------------------------------------------------------------- HF config


def _expected_shapes(args: Llama3Args) -> dict[str, torch.Size]:
    from titan.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    return {name: p.shape for name, p in model.state_dict().items()}


def check_state_matches(state: dict[str, torch.Tensor], args: Llama3Args, what: str = "state") -> None:
    """Raise a CheckpointError listing missing / unexpected / mis-shaped titan parameters."""
    want = _expected_shapes(args)
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


def _ffn_args(dim: int, intermediate: int) -> dict:
    """(multiple_of, ffn_dim_multiplier) that reproduce HF's intermediate_size exactly."""
    for flavor in LLAMA3_FLAVORS.values():  # the published Llama 3 choices first
        if flavor.dim == dim and flavor.ffn_hidden_dim == intermediate:
            return {"multiple_of": flavor.multiple_of, "ffn_dim_multiplier": flavor.ffn_dim_multiplier}
    hidden = int(2 * 4 * dim / 3)
    if intermediate >= hidden:
        for m in (4096, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
            if m * ((hidden + m - 1) // m) == intermediate:
                return {"multiple_of": m, "ffn_dim_multiplier": None}
    # any width: int(mult * hidden) == intermediate with multiple_of=1
    mult = intermediate / hidden
    for _ in range(4):
        if int(mult * hidden) == intermediate:
            return {"multiple_of": 1, "ffn_dim_multiplier": mult}
        mult = math.nextafter(mult, math.inf)
    raise CheckpointError(f"cannot express intermediate_size={intermediate} for dim={dim}")


def read_hf_config(hf_dir: str | Path) -> dict:
    file = Path(hf_dir) / HF_CONFIG
    if not file.is_file():
        raise CheckpointError(f"no {HF_CONFIG} in {str(hf_dir)!r}")
    return json.loads(file.read_text())


def llama3_args_from_hf_config(config: dict, max_seq_len: int | None = None) -> Llama3Args:
    """Map an HF Llama config (transformers 4.x `rope_scaling` or 5.x `rope_parameters`
    layout) to Llama3Args. Raises CheckpointError for what titan's Llama cannot express.

    `max_seq_len` (titan's RoPE table length) defaults to max_position_embeddings.
    `tie_word_embeddings` is accepted here; `load_hf` unties the weights (see module doc).
    """
    c = dict(config)
    problems = []
    model_type = c.get("model_type")
    archs = c.get("architectures") or []
    if model_type != "llama" and "LlamaForCausalLM" not in archs:
        problems.append(f"model_type={model_type!r} / architectures={archs} is not a Llama model")
    if c.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c['hidden_act']!r} (titan uses SwiGLU with silu)")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            problems.append(f"{key}=true (titan's projections have no bias)")
    dim, n_heads = c["hidden_size"], c["num_attention_heads"]
    if dim % n_heads:
        problems.append(f"hidden_size={dim} is not a multiple of num_attention_heads={n_heads}")
    head_dim = c.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        problems.append(f"head_dim={head_dim} != hidden_size/num_attention_heads={dim // n_heads} "
                        "(titan derives head_dim)")
    n_kv = c.get("num_key_value_heads") or n_heads
    if n_heads % n_kv:
        problems.append(f"num_attention_heads={n_heads} not a multiple of num_key_value_heads={n_kv}")

    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        problems.append("per-layer-type rope_parameters are not supported")
        rope = {}
    rope_theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = {}
    if rope_type == "llama3":
        scaling = {
            "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
            "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
            "rope_original_max_len": int(rope.get("original_max_position_embeddings",
                                                  c.get("max_position_embeddings", 8192))),
        }
    elif rope_type != "default":
        problems.append(f"rope type {rope_type!r} (titan implements plain RoPE and 'llama3' scaling)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1")
    if problems:
        raise CheckpointError("unsupported HF config for titan's Llama 3: " + "; ".join(problems))

    args = Llama3Args(
        dim=dim, n_layers=c["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=n_kv, vocab_size=c["vocab_size"], norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta), max_seq_len=int(max_seq_len or c.get("max_position_embeddings", 2048)),
        **_ffn_args(dim, c["intermediate_size"]), **scaling,
    )
    assert args.ffn_hidden_dim == c["intermediate_size"] and args.head_dim == dim // n_heads
    return args


def matching_flavor(args: Llama3Args) -> str | None:
    """Name of the registered Llama 3 flavor with the same architecture (vocab size and
    max_seq_len aside, FFN compared by width), or None."""
    def key(a: Llama3Args):
        return (a.dim, a.n_layers, a.n_heads, a.kv_heads, a.ffn_hidden_dim, a.norm_eps, a.rope_theta,
                a.rope_scaling_factor, a.rope_low_freq_factor if a.rope_scaling_factor else None,
                a.rope_high_freq_factor if a.rope_scaling_factor else None,
                a.rope_original_max_len if a.rope_scaling_factor else None)
    for name, flavor in LLAMA3_FLAVORS.items():
        if key(flavor) == key(args):
            return name
    return None


# ----------------------------------------------------------------------------- HF weights


def _stale_hf_weights(out_dir: Path) -> list[Path]:
    return [p for p in out_dir.iterdir()
            if p.name in (HF_SINGLE_FILE, HF_INDEX_FILE) or _SHARD_NAME.match(p.name)]


def save_hf(state_titan: dict[str, torch.Tensor], args: Llama3Args, out_dir: str | Path,
            dtype: str | torch.dtype = torch.float32,
            max_shard_size: int | str = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write an HF `LlamaForCausalLM` folder: config.json and safetensors weights.

    One `model.safetensors` when everything fits in `max_shard_size` bytes, else
    `model-0000X-of-0000Y.safetensors` shards plus `model.safetensors.index.json`.
    Weight files from an earlier export into the same folder are removed first; other
    files (tokenizer, README) are left alone.
    """
    from safetensors.torch import save_file

    dtype = to_dtype(dtype)
    limit = parse_size(max_shard_size)
    check_state_matches(state_titan, args, "titan state dict")
    adapter = Llama3StateDictAdapter(args)
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


def load_hf(hf_dir: str | Path, dtype: str | torch.dtype | None = None,
            args: Llama3Args | None = None) -> dict[str, torch.Tensor]:
    """An HF Llama folder as a titan state dict (titan names, titan q/k layout).

    `args` default: `llama3_args_from_hf_config(config.json)`. Tied embeddings are untied
    (lm_head := copy of embed_tokens) with a warning. `dtype` casts; None keeps the file's.
    """
    hf_dir = Path(hf_dir)
    config = read_hf_config(hf_dir)
    args = args or llama3_args_from_hf_config(config)
    hf = load_hf_state(hf_dir, dtype)
    if config.get("tie_word_embeddings", False):
        msg = (f"{str(hf_dir)!r} ties lm_head to embed_tokens; titan's output layer is untied, so "
               "it starts as a copy of the embedding and trains independently")
        warnings.warn(msg, stacklevel=2)
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone()
    state = Llama3StateDictAdapter(args).from_hf(hf)
    check_state_matches(state, args, f"HF weights in {str(hf_dir)!r}")
    return state
