"""A test-only model family: Llama 3 with a two-matrix GELU MLP in place of SwiGLU.

It proves the model contract: nothing in titan is edited for it. Everything a family provides
is here (args, model, TP plan, state-dict adapter, one TrainSpec); Llama's attention, pipeline
split and parallelize function are reused, the latter with this family's MLP plan.
`register()` is the one registry line a real family puts in titan/models/__init__.py.
"""

import functools
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan.models.init import normal
from titan.models.llama3.args import Llama3Args
from titan.models.llama3.model import Transformer, TransformerBlock
from titan.models.llama3.parallelize import parallelize_llama
from titan.models.llama3.pipeline import pipeline_llama
from titan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from titan.models.spec import TrainSpec, register_train_spec

NAME = "gelu_llama"


@dataclass(frozen=True)
class GeluLlamaArgs(Llama3Args):
    @property
    def ffn_hidden_dim(self) -> int:
        return 4 * self.dim

    def num_params(self, include_embedding: bool = True) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        per_layer = attn + 2 * d * self.ffn_hidden_dim + 2 * d
        total = self.n_layers * per_layer + d + self.vocab_size * d
        return total + (self.vocab_size * d if include_embedding else 0)


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden, bias=False)
        self.fc_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class GeluBlock(TransformerBlock):
    def __init__(self, layer_id: int, args: GeluLlamaArgs):
        super().__init__(layer_id, args)
        self.feed_forward = GeluMLP(args.dim, args.ffn_hidden_dim)

    def init_plan(self) -> dict:
        plan = {k: v for k, v in super().init_plan().items() if not k.startswith("feed_forward")}
        return {**plan, "feed_forward.fc_in.weight": normal(0.02),
                "feed_forward.fc_out.weight": plan["attention.wo.weight"]}


class GeluLlama(Transformer):
    block_cls = GeluBlock


def gelu_mlp_plan(between) -> dict:
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(between,),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.fc_in": ColwiseParallel(),
        "feed_forward.fc_out": RowwiseParallel(output_layouts=between),
    }


class GeluLlamaAdapter(Llama3StateDictAdapter):
    layer_names = {
        **{k: v for k, v in Llama3StateDictAdapter.layer_names.items()
           if not k.startswith("feed_forward")},
        "feed_forward.fc_in.weight": "mlp.fc_in.weight",
        "feed_forward.fc_out.weight": "mlp.fc_out.weight",
    }

    def hf_config(self) -> dict:
        return {**super().hf_config(), "architectures": ["GeluLlamaForCausalLM"],
                "model_type": NAME, "hidden_act": "gelu"}

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> GeluLlamaArgs:
        return GeluLlamaArgs(
            dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"], n_kv_heads=config["num_key_value_heads"],
            vocab_size=config["vocab_size"], norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            max_seq_len=max_seq_len or config["max_position_embeddings"])


FLAVORS = {"tiny": GeluLlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2)}


def register() -> None:
    register_train_spec(TrainSpec(
        name=NAME, model_cls=GeluLlama, flavors=FLAVORS,
        parallelize_fn=functools.partial(parallelize_llama, ffn_plan=gelu_mlp_plan),
        pipelining_fn=pipeline_llama, state_dict_adapter=GeluLlamaAdapter,
    ))
