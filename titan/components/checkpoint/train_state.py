"""The training state as DCP Statefuls: model parts, train counters and RNG, data position.

Everything they hand to DCP is a tensor (JSON becomes a uint8 tensor), so checkpoints load
into any parallel layout and nothing but DCP's own metadata is ever unpickled.
"""

import json
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from titan.components.checkpoint.tied_state import saved_form, saved_key, tied_names

logger = logging.getLogger(__name__)


def encode_json(obj) -> torch.Tensor:
    """Non-tensor state as a uint8 tensor: DCP then never needs to pickle it."""
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


def decode_json(t: torch.Tensor):
    return json.loads(bytes(t.tolist()).decode())


class ModelState:
    """All model parts (pipeline stages) as one state dict keyed by parameter name; a tied
    weight appears once, under its owner's name (`tied_state`).

    With `trained` (a predicate on names: the parameters training changes, LoRA's adapters)
    a training checkpoint holds those only, the rest coming from the base the run started
    from (`base()`: what an initial load fills); `merge` turns the whole state into the plain
    model's for exports (folding adapters into their weights)."""

    def __init__(
        self,
        parts: list[nn.Module],
        export_dtype: torch.dtype | None = None,
        *,
        trained: Callable[[str], bool] | None = None,
        merge: Callable[[dict], dict] | None = None,
        fold: Callable[[dict], dict] | None = None,
    ):
        self.parts, self.export_dtype = parts, export_dtype
        self.trained, self.merge, self.fold = trained, merge, fold
        self.ties = tied_names(parts)
        self._keep: Callable[[str], bool] | None = trained  # the keys this view reads
        self._merged = False
        self._folded = False

    @property
    def partial(self) -> bool:
        """Whether a training checkpoint of this state holds only part of the model."""
        return self.trained is not None

    def base(self) -> "ModelState":
        """The view an initial load (a base checkpoint, HF weights) fills: all but `trained`."""
        view = ModelState(self.parts, self.export_dtype)
        if self.trained is not None:
            view._keep = lambda k: not self.trained(k)
        return view

    def exported(self, dtype: torch.dtype | None, folded: bool = True) -> "ModelState":
        """The whole plain model in `dtype`: what a final model-only save writes; `folded`:
        with the run-time multipliers folded into the weights (`fold`: an export), else as
        trained (a seed checkpoint, which a run with the same converters starts from)."""
        view = ModelState(self.parts, dtype, merge=self.merge, fold=self.fold)
        view._merged = self.merge is not None
        view._folded = folded and self.fold is not None
        return view

    @property
    def folded(self) -> bool:
        """Whether this view's weights hold the run-time multipliers (an export's)."""
        return self._folded

    def _own(self, part: nn.Module) -> dict:
        sd = get_model_state_dict(part)
        return sd if self._keep is None else {k: v for k, v in sd.items() if self._keep(k)}

    def state_dict(self) -> dict:
        sd = {}
        for part in self.parts:
            sd.update(get_model_state_dict(part) if self._merged else self._own(part))
        if self._merged:
            sd = self.merge(sd)
        if self._folded:
            sd = self.fold(sd)
        sd = saved_form(sd, self.ties)
        if self.export_dtype is not None:
            sd = {k: v.to(self.export_dtype) for k, v in sd.items()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for part in self.parts:
            own = self._own(part)
            set_model_state_dict(
                part,
                {k: sd[saved_key(k, self.ties)] for k in own},
                options=StateDictOptions(strict=self._keep is None),
            )


class TrainState:
    def __init__(self):
        self.step = 0
        self.tokens_seen = 0
        # set before a load to the keys the checkpoint holds: one saved on CPU has no CUDA RNG
        # state, and DCP fails on a key the template asks for that the checkpoint lacks
        self.saved_keys: set[str] | None = None
        # the run's callbacks by name (titan.components.training.callbacks): their states
        # are saved and restored with the step
        self.callbacks: dict = {}

    def state_dict(self) -> dict:
        sd = {
            "step": torch.tensor(self.step),
            "tokens_seen": torch.tensor(self.tokens_seen),
            "rng_cpu": torch.get_rng_state(),
        }
        states = {name: cb.state_dict() for name, cb in self.callbacks.items()}
        states = {
            name: state
            for name, state in states.items()
            if state
            and (
                self.saved_keys is None
                or all(f"callbacks.{name}.{k}" in self.saved_keys for k in state)
            )
        }
        if states:
            sd["callbacks"] = states
        if torch.cuda.is_initialized() and (
            self.saved_keys is None or "rng_cuda" in self.saved_keys
        ):
            sd["rng_cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        saved = sd.get("callbacks", {})
        for name, callback in self.callbacks.items():
            if name in saved:
                callback.load_state_dict(saved[name])
            elif callback.state_dict():
                logger.info("the checkpoint holds no state of callback %s: it starts fresh", name)
        torch.set_rng_state(sd["rng_cpu"])
        if "rng_cuda" in sd:
            if torch.cuda.is_initialized():
                torch.cuda.set_rng_state(sd["rng_cuda"])
        elif torch.cuda.is_initialized():
            logger.warning(
                "the checkpoint holds no CUDA RNG state (saved without a GPU): the "
                "CUDA generator keeps this run's seed"
            )


class DataState:
    """The data position. Globally indexed loaders store the number of global batches consumed
    (the same on every rank, valid for any dp degree); per-rank streams store each dp rank's own
    stream state under its rank."""

    def __init__(self, dataloader, dp_rank: int, dp_world_size: int = 1):
        self.loader, self.dp_rank, self.dp_world_size = dataloader, dp_rank, dp_world_size
        self.global_index = dataloader.global_index
        self.load_sizes: dict[str, int] = {}  # set before a load: DCP fills same-size buffers

    @property
    def key(self) -> str:
        return "global" if self.global_index else f"dp_rank_{self.dp_rank}"

    def state_dict(self) -> dict:
        key = self.key
        if key in self.load_sizes:
            return {key: torch.zeros(self.load_sizes[key], dtype=torch.uint8)}
        return {key: encode_json(self.loader.state_dict())}

    def load_state_dict(self, sd: dict) -> None:
        self.loader.load_state_dict(decode_json(sd[self.key]))
