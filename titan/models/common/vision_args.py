"""Hyper-parameters of the vision tower (titan.models.common.vision) of Qwen3-VL and Qwen3.5,
torch-free. Defaults: the released towers' (27 blocks of width 1152, 16-pixel patches over 2
frames, 2x2 patches merged into one text token); `out_dim` is the text model's width and
`deepstack_layers` the blocks whose features Qwen3-VL also adds to its first decoder layers
(none in Qwen3.5)."""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class VisionArgs:
    depth: int = 27
    dim: int = 1152
    ffn_dim: int = 4304
    n_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2  # an image is its frame twice (the processor's rule)
    merge_size: int = 2  # merge_size x merge_size patches become one token of the text model
    out_dim: int = 3584
    # a square table of learned positions, resampled (bilinear) to each image's grid
    num_position_embeddings: int = 2304
    deepstack_layers: tuple[int, ...] = ()
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    def with_updates(self, **kw) -> "VisionArgs":
        return replace(self, **kw)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def patch_values(self) -> int:
        """The values of one patch as the processor flattens it: channels x frames x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def position_side(self) -> int:
        return int(round(self.num_position_embeddings**0.5))

    def training_flops(self, grids) -> float:
        """Forward and backward FLOPs of the tower on images of these `grids` ((frames, rows,
        columns) of patches): 6 x each patch's matmul parameters (the mergers' per merged
        token), and attention's 12 x depth x dim x n^2 over each frame of n patches (the
        PaLM / torchtitan convention the text model's figure follows)."""
        d, f, merged = self.dim, self.ffn_dim, self.dim * self.merge_size**2
        per_patch = self.patch_values * d + self.depth * (4 * d * d + 2 * d * f)
        mergers = (1 + len(self.deepstack_layers)) * (merged * merged + merged * self.out_dim)
        patches = sum(t * h * w for t, h, w in grids)
        attention = sum(t * 12 * self.depth * d * (h * w) ** 2 for t, h, w in grids)
        return 6 * patches * (per_patch + mergers / self.merge_size**2) + attention

    def problems(self) -> list[str]:
        out = []
        if self.dim % self.n_heads or self.head_dim % 4:
            out.append(
                f"vision dim {self.dim} must split into n_heads {self.n_heads} heads of a "
                "multiple of 4 dims (2D rotary positions: half for rows, half for columns)"
            )
        if self.position_side**2 != self.num_position_embeddings:
            out.append(
                f"vision num_position_embeddings {self.num_position_embeddings} is not a square"
            )
        bad = [i for i in self.deepstack_layers if not 0 <= i < self.depth]
        if bad:
            out.append(f"vision deepstack_layers {bad}: not blocks of a {self.depth}-block tower")
        return out

    def num_params(self) -> int:
        d, f, merged = self.dim, self.ffn_dim, self.dim * self.merge_size**2
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * f + f + d)
        merger_in = 2 * d  # its norm, before the patches are merged
        merger = merged * merged + merged + merged * self.out_dim + self.out_dim
        deepstack = len(self.deepstack_layers) * (2 * merged + merger)
        embed = self.patch_values * d + d + self.num_position_embeddings * d
        return embed + self.depth * block + merger_in + merger + deepstack


# CPU-sized: 2 blocks of width 64, 8-pixel patches; out_dim set to the text model's width
VISION_DEBUG = VisionArgs(
    depth=2,
    dim=64,
    ffn_dim=128,
    n_heads=4,
    patch_size=8,
    out_dim=256,
    num_position_embeddings=64,
)


@dataclass(frozen=True)
class VisionLanguageFields:
    """What a text family's args gain with a vision tower (`vision` None: text only, as the
    family's text flavors are). The token ids are the tokenizer's (the hub config's
    image_token_id, vision_start/end_token_id); the data find them by name."""

    vision: VisionArgs | None = None
    # how many rotated pairs turn with (time, rows, columns) (titan.models.common.mrope)
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    image_token_id: int = 151655
    vision_start_id: int = 151652
    vision_end_id: int = 151653

    def vision_problems(self, rotated_pairs: int) -> list[str]:
        """The tower's problems, and an mrope_section that does not share out the text
        model's `rotated_pairs`."""
        if self.vision is None:
            return []
        out = list(self.vision.problems())
        if sum(self.mrope_section) != rotated_pairs:
            out.append(
                f"mrope_section {self.mrope_section} must add up to the {rotated_pairs} "
                "rotated pairs of a head"
            )
        if self.vision.out_dim != self.dim:
            out.append(
                f"vision out_dim {self.vision.out_dim} must be the text model's dim {self.dim}"
            )
        return out

    def input_costs(self, batch: dict) -> tuple[float, dict[str, int]]:
        """The tower's FLOPs on the batch's images, and its image tokens."""
        grids = batch.get("image_grid_thw")
        if self.vision is None or grids is None:
            return 0.0, {}
        shapes = [tuple(g) for g in grids.reshape(-1, 3).tolist() if g[0] > 0]
        images = int((batch["vision_slots"] >= 0).sum())
        return self.vision.training_flops(shapes), {"image": images}

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """With the tower's, which no text token uses (`active`: those one text token uses)."""
        text = super().num_params(include_embedding, active)
        return text if active or self.vision is None else text + self.vision.num_params()


def check_deepstack_stage(job, plan) -> None:
    """DeepStack's features enter the first decoder layers from the tower, which a pipeline
    keeps on its first stage: those layers must be there too."""
    args = plan.model_args
    deep = len(args.vision.deepstack_layers) if getattr(args, "vision", None) else 0
    if not deep or not plan.dims.pp_enabled:
        return
    from titan.parallelisms.pipeline import PipelineConfigError, plan_pipelines

    try:
        plans = plan_pipelines(
            job.parallelism,
            n_layers=args.n_layers,
            local_batch_size=job.training.local_batch_size,
            layer_costs=args.layer_costs(),
        )
    except PipelineConfigError:
        return  # the layout's own check names it
    first = plans[0].layer_ranges[0]
    if deep > len(first):
        from titan.config import ConfigError

        raise ConfigError(
            f"parallelism.pipeline_parallel_degree {plan.dims.pp}: the first stage holds decoder "
            f"layers {first.start}..{first.stop - 1}, but the vision tower's DeepStack features "
            f"enter layers 0..{deep - 1} (on the first stage, with the tower); give the first "
            f"stage at least {deep} layers (parallelism.pipeline_parallel_layers_per_stage or "
            "pipeline_parallel_split_points)"
        )
