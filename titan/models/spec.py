"""The model contract and the train-spec registry.

A model family is a folder `titan/models/<family>/` that registers one TrainSpec, plus one
import line in `titan/models/__init__.py`; it builds on `titan/models/common/` (attention,
RoPE, decoder, parallelize policy, HF renaming). The trainer, the parallelisms, checkpoints
and HF conversion reach a family only through the protocols below, never through its
attributes; its own config section, if any, is `titan/models/<family>/options.py`
(titan.config.family_options).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from titan.config import extensions
from titan.config.family_options import FamilySection
from titan.models.args_base import OPTIONAL_MEMBERS

if TYPE_CHECKING:
    from titan.config import JobConfig
    from titan.models.common.decode import DecodeCache
    from titan.parallelisms.parallel_dims import ParallelDims
    from titan.parallelisms.pipeline import PipelinePlan


@runtime_checkable
class ModelArgs(Protocol):
    """The hyper-parameters of one flavor. Immutable: `with_updates` returns a copy.

    Beyond these, the members declared with their defaults in titan/models/args_base.py
    (`ModelArgsBase`: training_knobs, context_len, moe_args(), is_moe_layer(), problems(),
    layer_costs()), which a family's args class inherits and overrides where it has them."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # width of one attention head (Qwen3's is not dim / n_heads)
    vocab_size: int
    max_seq_len: int  # length of position tables (the RoPE cache): the training seq_len

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        """All parameters, or (`active`) those one token uses: a mixture of experts counts
        only the experts a token is routed to."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token, for MFU: active parameters only."""
        ...

    def with_updates(self, **changes: Any) -> ModelArgs: ...


@runtime_checkable
class Model(Protocol):
    """What the trainer needs of a built model, beyond being an `nn.Module`."""

    def init_weights(self, seed: int, buffer_device: torch.device | None = None) -> None:
        """Fill every parameter from (seed, its name), whatever the sharding; rebuild buffers."""
        ...

    def cp_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """(buffer, sequence dim) pairs that context parallelism shards with the batch,
        e.g. position tables; empty when the model holds none."""
        ...

    def tied_parameters(self) -> list[tuple[str, str]]:
        """(name, other name) of parameters that are one weight (a tied embedding), the name
        HF files store first; pipeline stages that split a pair keep copies in step."""
        ...

    # whether forward takes the step's labels as `labels=` (the trainer then passes them, to
    # every pipeline stage): for objectives computed inside forward (multi-token prediction)
    takes_labels: bool

    # the batch fields beyond input_ids and labels (titan.components.data.batch) that forward
    # takes as keyword arguments of the same names (a family's positions, images, ...);
    # the documents of a block-causal mask are passed apart, as doc_ids
    batch_fields: tuple[str, ...]
    # those of batch_fields that are per row, (rows, ...), not per token (a row's images):
    # pipelines split them by rows, context parallelism leaves them whole
    row_fields: tuple[str, ...]

    def forward(self, tokens: torch.Tensor, cache: DecodeCache | None = None) -> torch.Tensor:
        """Logits; with a cache (generation), `tokens` continue the cached ones. Auxiliary
        losses (an MoE's load balancing) ride on an activation through
        `titan.models.common.aux_loss` (attach_aux_loss, attach_group_loss): backward sees
        them, metrics log them
        under their names, and `loss` stays the cross-entropy."""
        ...


class StateDictAdapter(Protocol):
    """Maps a family's state dict and config to and from the Hugging Face layout."""

    # config.json's model_type(s) of the family: how an HF folder names it
    hf_model_types: tuple[str, ...]

    def __init__(self, args: ModelArgs) -> None: ...

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> ModelArgs:
        """The ModelArgs an HF config.json describes; raises ValueError (naming the fields)
        for what the family cannot express."""
        ...

    def hf_config(self) -> dict:
        """config.json contents for these args (torch_dtype left to the writer)."""
        ...

    @classmethod
    def export_problems(cls, args: ModelArgs) -> list[str]:
        """Why these args cannot be written in the hub layout (empty: they can)."""
        ...

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def from_hf(
        self, hf_state_dict: dict[str, torch.Tensor], hf_config: dict | None = None
    ) -> dict[str, torch.Tensor]: ...


class ParallelizeFn(Protocol):
    """Applies TP -> AC -> compile -> FSDP/DDP to one model part (CP runs per batch, in the
    trainer) and returns it; the part is still on the meta device."""

    def __call__(self, model: nn.Module, dims: ParallelDims, job: JobConfig) -> nn.Module: ...


class PipeliningFn(Protocol):
    """Cuts the stage `stage_id` of `plan` out of the whole meta-device model, keeping the
    original parameter names."""

    def __call__(self, whole: nn.Module, stage_id: int, plan: PipelinePlan) -> nn.Module: ...


class PostOptimizerHook(Protocol):
    """Makes, from the built model parts and the job, the callable run after every step
    (None: nothing to do in this run), called with whether the optimizer stepped: a skipped
    step (non-finite loss, torchft's quorum not committed) must leave no trace of what its
    forward gathered. After a taken step the callable may return metrics of the step, logged
    at the next log step: numbers in metrics.jsonl and TensorBoard, lists of numbers as
    TensorBoard histograms. Every rank runs it: it may use collectives."""

    def __call__(
        self, parts: list[nn.Module], job: JobConfig
    ) -> Callable[[bool], dict | None] | None: ...


class _NoRandomInitOnMeta(TorchFunctionMode):
    """Skips the modules' random initializations of meta tensors (init_weights initializes
    the materialized model): there is nothing to fill, and torch's meta `normal_` imports
    torch._dynamo on its first call, 1.2 s of every rank's start-up."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        initializes = getattr(func, "__module__", None) == "torch.nn.init" or func in (
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
        )
        if initializes and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


@dataclass(frozen=True)
class TrainSpec(FamilySection):
    """A model family: `model.name` names it. Its own [<name>] section, for a family outside
    titan/models (titan's own declare theirs in options.py), is `options`; its checks of the
    planned run (`plan_check`), beside its args' `problems()`, run when the run trains it."""

    kind: ClassVar[str] = "train spec"
    model_cls: type[nn.Module]  # model_cls(args) builds a Model
    flavors: Mapping[str, ModelArgs]
    parallelize_fn: ParallelizeFn
    pipelining_fn: PipeliningFn | None = None
    state_dict_adapter: type[StateDictAdapter] | None = None
    # each makes, from the built model parts and the job, a callable run after every step
    # (or None: nothing to do in this run), e.g. an MoE's router-bias update
    post_optimizer_hooks: tuple[PostOptimizerHook, ...] = ()
    # earlier docs' name of `options`
    family_options: type | None = None

    def __post_init__(self) -> None:
        if self.family_options is not None and self.options is None:
            object.__setattr__(self, "options", self.family_options)
        super().__post_init__()
        _check_protocols(self)

    def build_meta(self, args: ModelArgs) -> nn.Module:
        """The model with parameters on the meta device: shapes, no memory."""
        with torch.device("meta"), _NoRandomInitOnMeta():
            return self.model_cls(args)

    def state_shapes(self, args: ModelArgs) -> dict[str, torch.Size]:
        return {name: t.shape for name, t in self.build_meta(args).state_dict().items()}

    def vocab_size_of(self, shapes: Mapping[str, torch.Size], args: ModelArgs) -> int:
        """The vocabulary of a state with these parameter shapes (a checkpoint's: trained with
        its tokenizer's, not the flavor's): the dimension that moves with vocab_size."""
        a, b = (self.state_shapes(args.with_updates(vocab_size=v)) for v in (3, 5))
        for name, shape in a.items():
            for dim, (x, y) in enumerate(zip(shape, b[name])):
                if (x, y) == (3, 5) and name in shapes:
                    return shapes[name][dim]
        raise ValueError("cannot tell the vocabulary size: no vocabulary-sized parameter")

    def matching_flavor(self, args: ModelArgs) -> str | None:
        """The registered flavor with this architecture (vocab size and max_seq_len aside)."""
        for name, flavor in self.flavors.items():
            if (
                flavor.with_updates(vocab_size=args.vocab_size, max_seq_len=args.max_seq_len)
                == args
            ):
                return name
        return None


def _check_protocols(spec: TrainSpec) -> None:
    """TypeError for a family that lacks what titan asks of every one."""
    missing = [
        m
        for m in ("init_weights", "cp_buffers", "tied_parameters")
        if not callable(getattr(spec.model_cls, m, None))
    ]
    if missing:
        raise TypeError(
            f"{spec.model_cls.__name__} lacks {', '.join(missing)} of the Model "
            "protocol (titan/models/spec.py)"
        )
    bad = [name for name, args in spec.flavors.items() if not isinstance(args, ModelArgs)]
    if bad:
        raise TypeError(f"flavors {bad} of {spec.name!r} do not satisfy the ModelArgs protocol")
    for name, args in spec.flavors.items():
        lacking = [m for m in OPTIONAL_MEMBERS if not hasattr(args, m)]
        if lacking:
            raise TypeError(
                f"flavor {name!r} of {spec.name!r} lacks {', '.join(lacking)}: its args class "
                "should inherit titan.models.args_base.ModelArgsBase (their defaults)"
            )
    adapter = spec.state_dict_adapter
    if adapter is not None and not callable(getattr(adapter, "export_problems", None)):
        raise TypeError(
            f"{adapter.__name__} lacks export_problems: inherit "
            "titan.models.common.hf_adapter.DecoderHFAdapter or define it"
        )


_FAMILIES = extensions.Registry(TrainSpec.kind)


def _registry() -> dict[str, TrainSpec]:
    return _FAMILIES.entries


def register_train_spec(spec: TrainSpec) -> None:
    extensions.said_once("register_train_spec(spec)", "titan.config.extensions.register(spec)")
    extensions.register(spec)


def unregister_train_spec(name: str) -> None:
    _FAMILIES.remove(name)


def _load_families() -> None:
    """titan's own families register when their package is imported (by name: the registry
    sits below the families that fill it)."""
    importlib.import_module("titan.models")


def get_train_spec(name: str) -> TrainSpec:
    _load_families()

    if name not in _registry():
        raise KeyError(f"unknown model.name {name!r}; registered: {', '.join(sorted(_registry()))}")
    return _registry()[name]


def family_of_hf_config(config: dict) -> str | None:
    """The registered family whose adapter reads this HF config.json's model_type."""
    _load_families()

    for name, spec in sorted(_registry().items()):
        adapter = spec.state_dict_adapter
        if adapter is not None and config.get("model_type") in getattr(
            adapter, "hf_model_types", ()
        ):
            return name
    return None


def registered_names() -> list[str]:
    _load_families()

    return sorted(_registry())
