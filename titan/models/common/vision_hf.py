"""The hub layout of a vision-language checkpoint (Qwen3-VL's, Qwen3.5's): the text model
under `model.language_model.`, the tower under `model.visual.` with transformers' names, the
output as `lm_head`. Mixed in before a family's text adapter, which maps the text model as its
own text checkpoints name it (`model.`); a flavor without a tower keeps the text layout."""

from titan.models.common.vision_args import VisionArgs

TEXT, VISUAL = "model.language_model.", "model.visual."
_PATCH = "visual.patch_embed.proj.weight"  # a Conv3d in the hub, titan's matmul of it


class VisionLanguageHF:
    def _tower(self) -> VisionArgs | None:
        return getattr(self.args, "vision", None)

    def follow_files(self, file_names) -> dict[str, str]:
        kept = super().follow_files(file_names)
        if self._tower() is None:
            return kept
        # to_hf names the files' tensors as they are; the tower's are read too (what else the
        # files hold beside the model, an MTP layer, is not)
        kept = set(kept.values())
        return {n: n for n in file_names if n in kept or n.startswith(VISUAL)}

    def to_hf(self, state_dict):
        if self._tower() is None:
            return super().to_hf(state_dict)
        tower = {k: v for k, v in state_dict.items() if k.startswith("visual.")}
        text = super().to_hf({k: v for k, v in state_dict.items() if k not in tower})
        out = {_wrapped(k): v for k, v in text.items()}
        for name, t in tower.items():
            if name == _PATCH:
                v = self._tower()
                t = t.view(t.shape[0], v.in_channels, v.temporal_patch_size, *[v.patch_size] * 2)
            out["model." + name] = t
        return out

    def from_hf(self, hf_state_dict, hf_config=None):
        if self._tower() is None:
            return super().from_hf(hf_state_dict, hf_config)
        tower = {k[len("model.") :]: v for k, v in hf_state_dict.items() if k.startswith(VISUAL)}
        text = {
            ("model." + k[len(TEXT) :] if k.startswith(TEXT) else k): v
            for k, v in hf_state_dict.items()
            if not k.startswith(VISUAL)
        }
        out = super().from_hf(text, hf_config)
        if _PATCH in tower:
            tower[_PATCH] = tower[_PATCH].flatten(1)
        return {**out, **tower}


def _wrapped(name: str) -> str:
    return TEXT + name[len("model.") :] if name.startswith("model.") else name


def vision_hf_config(v: VisionArgs, model_type: str) -> dict:
    """The hub's vision_config of a tower."""
    return {
        "model_type": model_type,
        "depth": v.depth,
        "hidden_size": v.dim,
        "intermediate_size": v.ffn_dim,
        "num_heads": v.n_heads,
        "in_channels": v.in_channels,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.merge_size,
        "out_hidden_size": v.out_dim,
        "num_position_embeddings": v.num_position_embeddings,
        "hidden_act": "gelu_pytorch_tanh",
        **({"deepstack_visual_indexes": list(v.deepstack_layers)} if v.deepstack_layers else {}),
    }


def vision_args_from_hf(c: dict, out_dim: int, problems: list[str]) -> VisionArgs:
    """The VisionArgs of a hub vision_config (ValueError-worthy fields go to `problems`)."""
    if c.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        problems.append(f"vision hidden_act={c['hidden_act']!r} (titan's tower: tanh GELU)")
    for key in ("patch_size", "temporal_patch_size"):
        if isinstance(c.get(key), (list, tuple)):
            problems.append(f"vision {key}={c[key]} (titan's tower: one size)")
    return VisionArgs(
        depth=c.get("depth", 27),
        dim=c.get("hidden_size", 1152),
        ffn_dim=c.get("intermediate_size", 4304),
        n_heads=c.get("num_heads", 16),
        in_channels=c.get("in_channels", 3),
        patch_size=c.get("patch_size", 16),
        temporal_patch_size=c.get("temporal_patch_size", 2),
        merge_size=c.get("spatial_merge_size", 2),
        out_dim=c.get("out_hidden_size", out_dim),
        num_position_embeddings=c.get("num_position_embeddings", 2304),
        deepstack_layers=tuple(c.get("deepstack_visual_indexes") or ()),
    )


def mrope_of(text_config: dict, default: tuple[int, int, int]) -> tuple[int, int, int]:
    """A hub text_config's mrope_section (`default` where it has none)."""
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    return default if section is None else tuple(int(s) for s in section)


def vision_language_config(
    args, architecture: str, model_type: str, text: dict, vision_type: str
) -> dict:
    """The hub config of a vision-language model: `text` (the text model's config) under
    text_config, the tower's under vision_config, the vision tokens' ids."""
    text = {k: v for k, v in text.items() if k != "architectures"}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision_hf_config(args.vision, vision_type),
        "image_token_id": args.image_token_id,
        "video_token_id": args.image_token_id + 1,
        "vision_start_token_id": args.vision_start_id,
        "vision_end_token_id": args.vision_end_id,
        "tie_word_embeddings": args.tie_word_embeddings,
        "torch_dtype": text.get("torch_dtype", "float32"),
    }


def vision_fields(config: dict, dim: int, problems: list[str]) -> dict:
    """The VisionLanguageFields of a hub config beside its text model of width `dim`: none
    for a text model's config."""
    if "vision_config" not in config:
        return {}
    ids = {
        "image_token_id": "image_token_id",
        "vision_start_id": "vision_start_token_id",
        "vision_end_id": "vision_end_token_id",
    }
    return {
        "vision": vision_args_from_hf(config["vision_config"] or {}, dim, problems),
        **{ours: int(config[theirs]) for ours, theirs in ids.items() if theirs in config},
    }
