"""Map a `Decoder`'s state dict to and from the Hugging Face hub layout
(`model.embed_tokens`, `model.layers.N.<...>`, `model.norm`, `lm_head`).

A family names its block's parameters in HF terms (`layer_names`) and says whether it
rotates interleaved pairs: HF rotates the two halves of each head, so an interleaved
family's q/k projection rows are permuted on the way across. A tied model
(`tie_word_embeddings`) stores its one matrix as embed_tokens only, as HF does; a pipeline
stage that holds only the output layer's copy of it reads and writes it under that name too.

Routed experts are one stacked (experts, ...) tensor in titan and, in the hub layout, either
one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, what transformers' save_pretrained
writes for Qwen3-MoE and DeepSeek-V3): `expert_names` maps the one to the other; or one tensor
for all experts, possibly holding two of titan's interleaved (GPT-OSS's `gate_up_proj`, gate
and up columns alternating) and each expert's matrix stored as (in, out): `fused_expert_names`.
A rank whose stacked tensor is sharded over experts (FSDP's Shard(0)) names only the experts it
holds: per-expert tensors as views of its shard, so an HF load reads only those, straight into
the parameter; a fused tensor as its rows of the HF tensor, in the same sharding.
"""

import re
from dataclasses import dataclass

import torch

from titan.models.common.moe_args import MoEArgs

TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# what every family's block holds under the same names: the attention output projection, the
# two norms and the dense SwiGLU (titan name within a block -> HF name within a layer)
BLOCK_NAMES = {
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
# an MoE block (titan.models.common.moe): the router's projection, and the routed experts as
# one HF tensor per expert (what transformers' save_pretrained writes)
ROUTER_NAMES = {"feed_forward.router.gate.weight": "mlp.gate.weight"}
SWIGLU_EXPERT_NAMES = {
    "feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
    "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
    "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight",
}
_TITAN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^(.+)\.(\d+)\.([^.]+\.weight)$")  # mlp.experts.7.gate_proj.weight


def _local_experts(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the stacked experts this rank holds, the index of the first): a DTensor sharded over
    experts (dim 0) holds a contiguous range of them. So does FSDP's strided shard of the
    experts an ep rank holds: it splits the range the later Shard(0) dims left."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return t, 0
    mesh, placements = t.device_mesh, t.placements

    def whole_range(i, p) -> bool:
        if p.is_replicate() or (type(p) is Shard and p.dim == 0):
            return True
        later = 1
        for j in range(i + 1, len(placements)):
            if placements[j].is_shard(0):
                later *= mesh.size(j)
        return isinstance(p, _StridedShard) and p.dim == 0 and p.split_factor == later

    if not all(whole_range(i, p) for i, p in enumerate(placements)):
        raise NotImplementedError(
            f"experts sharded as {placements}: only whole experts "
            "(Shard(0)) or replicas map to per-expert HF tensors"
        )
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), offset[0]


@dataclass(frozen=True)
class FusedExperts:
    """One HF tensor (experts, ...) holding titan's stacked `parts` (names within a block),
    interleaved along its last dimension when there are several (gate, up, gate, up, ...), or
    (`concatenated`) one after another along each expert's output rows (all gate rows, then
    all up rows); `transposed`: HF stores each expert's matrix as (in, out), titan as
    (out, in)."""

    parts: tuple[str, ...]
    transposed: bool = False
    concatenated: bool = False


def _global(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` (a rank's experts) as a tensor sharded as `like` over experts, when `like` is a
    DTensor; as is otherwise."""
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    shape = torch.Size((like.shape[0], *local.shape[1:]))
    local = local.contiguous()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, like.device_mesh, like.placements, shape=shape, stride=stride)


def _fuse(parts: list[torch.Tensor], spec: FusedExperts) -> torch.Tensor:
    locals_ = [_local_experts(t)[0] for t in parts]
    if spec.transposed:
        locals_ = [t.transpose(-2, -1) if t.ndim == 3 else t for t in locals_]
    if len(locals_) == 1:
        fused = locals_[0]
    elif spec.concatenated:
        fused = torch.cat(locals_, dim=-2)
    else:
        fused = torch.stack(locals_, dim=-1).flatten(-2)
    # a file stores it packed (safetensors refuses a transposed view)
    return _global(fused.contiguous(), parts[0])


def _unfuse(fused: torch.Tensor, spec: FusedExperts) -> list[torch.Tensor]:
    local, _ = _local_experts(fused)
    n, out = len(spec.parts), []
    rows = local.shape[-2] // n
    for i in range(n):
        if n == 1:
            piece = local
        elif spec.concatenated:
            piece = local[..., i * rows : (i + 1) * rows, :]
        else:
            piece = local[..., i::n]
        if spec.transposed and piece.ndim == 3:
            piece = piece.transpose(-2, -1)
        out.append(_global(piece.contiguous(), fused))
    return out


def _permute_rows(w: torch.Tensor, n_heads: int, to_halves: bool) -> torch.Tensor:
    """Reorder the rows of each head between the interleaved and the two-halves layout.

    A DTensor sharded along whole heads is permuted shard by shard, with no communication;
    one whose shards cut through heads is gathered for this one tensor, permuted, and
    resharded as it was."""
    rows, cols = w.shape
    split = (n_heads, rows // n_heads // 2, 2) if to_halves else (n_heads, 2, rows // n_heads // 2)

    def permute(t):
        return t.view(*split, cols).transpose(1, 2).reshape(rows, cols)

    try:
        return permute(w)
    except RuntimeError:
        from torch.distributed.tensor import DTensor

        if not isinstance(w, DTensor):
            raise
        return on_whole(permute, w)


def on_whole(fn, *tensors: torch.Tensor):
    """`fn(*tensors)`, a tensor or a tuple of them, computed on whole tensors: DTensors are
    gathered for this one call and each result sharded as the first of them was (a row
    reordering whose rows cross the shards' boundaries)."""
    from torch.distributed.tensor import DTensor, Replicate

    like = tensors[0]
    if not isinstance(like, DTensor):
        return fn(*tensors)
    out = fn(*(t.full_tensor() for t in tensors))
    replicated = [Replicate()] * like.device_mesh.ndim

    def reshard(t: torch.Tensor) -> torch.Tensor:
        whole = DTensor.from_local(t.contiguous(), like.device_mesh, replicated)
        return whole.redistribute(placements=like.placements)

    return reshard(out) if isinstance(out, torch.Tensor) else tuple(reshard(t) for t in out)


# a decoder_hf_config field a family's config does not have
LEAVE_OUT = object()
# HF config field -> the args' field it is written from
_ARGS_FIELDS = {
    "hidden_size": "dim",
    "intermediate_size": "ffn_hidden_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "norm_eps",
    "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
}


def sparse_step_moe_hf_fields(args) -> dict:
    """The HF config fields of Qwen's MoE layers (Qwen3-MoE, Qwen3-Next, Qwen3.5): every
    `decoder_sparse_step`-th layer routed except `mlp_only_layers`; a dense model's as
    transformers' defaults read them."""
    m = args.moe
    return {
        "num_experts": 0 if m is None else m.n_experts,
        "num_experts_per_tok": 1 if m is None else m.top_k,
        "moe_intermediate_size": 0 if m is None else m.hidden_dim,
        "norm_topk_prob": True if m is None else m.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        # transformers adds the loss only with output_router_logits, as released
        "router_aux_loss_coef": args.moe_aux_loss_coeff,
        "output_router_logits": False,
    }


class DecoderHFAdapter:
    """The renaming and permuting half of a StateDictAdapter (titan/models/spec.py); a
    family adds `hf_config` and `args_from_hf_config`."""

    family = "decoder"  # how error messages name the family

    @classmethod
    def export_problems(cls, args) -> list[str]:
        """Why these args cannot be written in the hub layout (empty: they can)."""
        return []

    layer_names: dict[str, str] = {}  # titan name within a block -> HF name within a layer
    # titan's stacked experts within a block -> the HF name of one, with {e} for its index
    expert_names: dict[str, str] = {}
    # HF name within a layer of a tensor holding every expert -> what of titan's it holds
    fused_expert_names: dict[str, FusedExperts] = {}
    interleaved_rope = False  # True: q/k rows are permuted between the two layouts
    # a checkpoint holding the decoder inside a larger model (a vision-language model's
    # language tower) names it under another prefix: (the file's prefix, the decoder's)
    wrapped_prefixes: tuple[tuple[str, str], ...] = ()
    # what such a checkpoint holds beside the decoder that titan does not train (a vision
    # tower, multi-token-prediction layers): left in the files
    foreign_prefixes: tuple[str, ...] = ()

    def decoder_hf_config(self, architecture: str, model_type: str, **fields) -> dict:
        """The HF config of a decoder: the fields every family writes alike from its args,
        then the family's own `fields` (a value of LEAVE_OUT leaves that field out)."""
        a = self.args
        cfg = {"architectures": [architecture], "model_type": model_type}
        # read only where the family does not say otherwise (its args may lack the field)
        cfg.update((k, getattr(a, attr)) for k, attr in _ARGS_FIELDS.items() if k not in fields)
        cfg.update(
            max_position_embeddings=a.context_len or a.max_seq_len,
            hidden_act="silu",
            attention_bias=False,
            torch_dtype="float32",
        )
        cfg.update(fields)
        return {k: v for k, v in cfg.items() if v is not LEAVE_OUT}

    def follow_files(self, file_names) -> dict[str, str]:
        """{the name to_hf and from_hf use: the file's name} of a checkpoint's tensors, the
        parts foreign to the decoder left out; to_hf then names the routed experts as these
        files store them (a family that reads both layouts)."""
        out = {}
        for name in file_names:
            if name.startswith(self.foreign_prefixes):
                continue
            mine = name
            for wrapped, plain in self.wrapped_prefixes:
                if name.startswith(wrapped):
                    mine = plain + name[len(wrapped) :]
                    break
            out[mine] = name
        per_expert = set(self.expert_names.values())

        def one_per_expert(name: str) -> bool:
            layer = _HF_LAYER.match(name)
            e = layer and _HF_EXPERT.match(layer[2])
            return bool(e) and f"{e[1]}.{{e}}.{e[3]}" in per_expert

        self._per_expert_files = any(one_per_expert(n) for n in out)
        return out

    def __init__(self, args):
        self.args = args
        self._heads = (
            {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.n_kv_heads}
            if self.interleaved_rope
            else {}
        )
        # titan name -> (stacked tensor, first expert held) of the last to_hf: from_hf hands
        # back that very tensor when the per-expert views it made were loaded in place
        self._split: dict[str, tuple[torch.Tensor, int]] = {}
        self._per_expert_files = False  # follow_files saw one tensor per expert

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        fused = {} if self._per_expert_files else self.fused_expert_names
        fused_of = {p: hf for hf, f in fused.items() for p in f.parts}
        fusing: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for name, t in state_dict.items():
            m = _TITAN_LAYER.match(name)
            if m is None:
                if name not in TOP_NAMES:
                    raise KeyError(f"no HF name for titan parameter {name!r}")
                if name == "output.weight" and self.args.tie_word_embeddings:
                    if "tok_embeddings.weight" in state_dict:
                        continue  # the same matrix, stored once
                    name = "tok_embeddings.weight"  # a last pipeline stage's copy
                out[TOP_NAMES[name]] = t
                continue
            layer, rest = m.groups()
            if rest in fused_of:
                fusing.setdefault((layer, fused_of[rest]), {})[rest] = t
                continue
            if rest in self.expert_names:
                local, first = _local_experts(t)
                self._split[name] = (t, first)
                pattern = f"model.layers.{layer}.{self.expert_names[rest]}"
                out.update({pattern.format(e=first + i): w for i, w in enumerate(local)})
                continue
            if rest not in self.layer_names:
                raise KeyError(f"no HF name for titan parameter {name!r}")
            if rest in self._heads:
                t = _permute_rows(t, self._heads[rest], to_halves=True)
            out[f"model.layers.{layer}.{self.layer_names[rest]}"] = t
        for (layer, hf_name), held in fusing.items():
            spec = self.fused_expert_names[hf_name]
            if set(held) != set(spec.parts):
                raise KeyError(
                    f"layer {layer} holds {sorted(held)} of the parts of HF {hf_name!r}, "
                    f"which are {list(spec.parts)}"
                )
            out[f"model.layers.{layer}.{hf_name}"] = _fuse([held[p] for p in spec.parts], spec)
        return out

    def from_hf(
        self, hf_state_dict: dict[str, torch.Tensor], hf_config: dict | None = None
    ) -> dict[str, torch.Tensor]:
        tied = self.args.tie_word_embeddings
        if tied:  # some tied repos also store lm_head: HF ignores it, and so does titan
            hf_state_dict = {k: v for k, v in hf_state_dict.items() if k != "lm_head.weight"}
        top = {v: k for k, v in TOP_NAMES.items()}
        layer_map = {v: k for k, v in self.layer_names.items()}
        expert_map = {v.format(e="{e}"): k for k, v in self.expert_names.items()}
        out, experts = {}, {}
        for name, t in hf_state_dict.items():
            if "rotary_emb" in name:
                continue  # HF may store inv_freq; titan recomputes it
            m = _HF_LAYER.match(name)
            if m is None:
                if name not in top:
                    raise KeyError(f"unexpected HF parameter {name!r} for a {self.family} model")
                out[top[name]] = t
                continue
            layer, rest = m.groups()
            if rest in self.fused_expert_names:
                spec = self.fused_expert_names[rest]
                for part, piece in zip(spec.parts, _unfuse(t, spec), strict=True):
                    out[f"layers.{layer}.{part}"] = piece
                continue
            e = _HF_EXPERT.match(rest)
            if e is not None and f"{e[1]}.{{e}}.{e[3]}" in expert_map:
                key = f"layers.{layer}.{expert_map[f'{e[1]}.{{e}}.{e[3]}']}"
                experts.setdefault(key, {})[int(e[2])] = t
                continue
            if rest not in layer_map:
                raise KeyError(f"unexpected HF parameter {name!r} for a {self.family} model")
            titan_name = layer_map[rest]
            if titan_name in self._heads:
                t = _permute_rows(t, self._heads[titan_name], to_halves=False)
            out[f"layers.{layer}.{titan_name}"] = t
        out.update({name: self._stacked(name, pieces) for name, pieces in experts.items()})
        if tied and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out

    def _stacked(self, name: str, pieces: dict[int, torch.Tensor]) -> torch.Tensor:
        """One titan tensor from its experts' HF tensors: all of them, or the range this rank
        holds of the stacked tensor to_hf split (returned as that tensor, in its sharding)."""
        split, first = self._split.get(name, (None, 0))
        order = sorted(pieces)
        if order != list(range(first, first + len(order))):
            raise KeyError(
                f"HF experts of {name!r}: indices {order[:8]}... are not a "
                f"contiguous range from {first}"
            )
        if split is not None:
            local, _ = _local_experts(split)
            if len(order) == local.shape[0]:
                if all(
                    pieces[first + i].data_ptr() == local[i].data_ptr() for i in range(len(order))
                ):
                    return split  # loaded in place, through the views to_hf made
                if local is not split:  # a rank's shard of a DTensor, filled from copies
                    from torch.distributed.tensor import DTensor

                    return DTensor.from_local(
                        torch.stack([pieces[e] for e in order]),
                        split.device_mesh,
                        split.placements,
                        shape=split.shape,
                        stride=split.stride(),
                    )
        return torch.stack([pieces[e] for e in order])


def rope_settings(config: dict) -> tuple[float, str, dict, list[str]]:
    """(rope_theta, rope type, its parameters, problems) of an HF config, in transformers 4.x
    (`rope_scaling`) or 5.x (`rope_parameters`) layout."""
    problems = []
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        problems.append("per-layer-type rope_parameters are not supported")
        rope = {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1")
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    return float(theta), rope.get("rope_type", rope.get("type", "default")), rope, problems


def yarn_fields(rope: dict, config: dict, problems: list[str]) -> dict:
    """The YaRN fields of a family's args (rope_scaling_factor, rope_original_max_len,
    rope_beta_fast, rope_beta_slow) from an HF config's YaRN parameters, for a family that
    takes YaRN's default temperature; what it cannot express goes to `problems`."""
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if rope.get(key) is not None:
            problems.append(f"YaRN {key} (titan uses YaRN's default temperature)")
    return {
        "rope_scaling_factor": float(rope["factor"]),
        "rope_original_max_len": int(
            rope.get("original_max_position_embeddings") or config.get("max_position_embeddings")
        ),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
    }


def gqa_heads(config: dict, problems: list[str]) -> tuple[int, int]:
    """(num_attention_heads, num_key_value_heads, all heads when absent) of an HF config; a
    query head count the key/value heads do not divide goes to `problems`."""
    n_heads = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_heads
    if n_heads % n_kv:
        problems.append(
            f"num_attention_heads={n_heads} not a multiple of num_key_value_heads={n_kv}"
        )
    return n_heads, n_kv


def sparse_moe_fields(c: dict, problems: list[str], norm_topk_prob: bool = False) -> dict:
    """The MoE fields (titan.models.common.moe_args.SparseStepMoE's) of a Qwen3-MoE or
    Qwen3-Next config; what titan cannot express goes to `problems` (experts, top-k and layer
    choice checked like titan's own settings). `norm_topk_prob`: the config class's default."""
    # transformers 5 writes num_local_experts (its attribute_map), 4.x num_experts
    n_experts = int(c.get("num_experts", c.get("num_local_experts", 0)))
    if n_experts == 0:
        return {}  # every layer dense
    moe = MoEArgs(
        n_experts=n_experts,
        top_k=int(c.get("num_experts_per_tok", 1)),
        hidden_dim=int(c["moe_intermediate_size"]),
        norm_topk_prob=bool(c.get("norm_topk_prob", norm_topk_prob)),
    )
    problems += [f"{p} (num_experts / num_experts_per_tok)" for p in moe.problems()]
    n_layers = int(c["num_hidden_layers"])
    only = tuple(int(i) for i in c.get("mlp_only_layers") or ())
    bad = [i for i in only if not 0 <= i < n_layers]
    if bad:
        problems.append(f"mlp_only_layers {bad} are not layers of a {n_layers}-layer model")
    step = int(c.get("decoder_sparse_step", 1))
    if step < 1:
        problems.append(f"decoder_sparse_step {step} must be >= 1")
    return {
        "moe": moe,
        "decoder_sparse_step": step,
        "mlp_only_layers": only,
        "moe_aux_loss_coeff": float(c.get("router_aux_loss_coef", 0.0)),
    }
