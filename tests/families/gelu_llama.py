"""A test-only model family: Llama 3 with a two-matrix GELU MLP in place of SwiGLU.

It proves the model contract: nothing in titan is edited for it. It also uses what the
contract offers beyond a plain decoder: an auxiliary loss, a post-optimizer-step hook and a
config section of its own ([gelu_llama], its TrainSpec's options). Everything a
family provides is here (args, model, TP plan, state-dict adapter, one TrainSpec), built only from
titan/models/common: its attention, decoder, pipeline split, HF renaming and parallelize
policy, the latter with this family's MLP plan.
`register()` is the one registry line a real family puts in titan/models/__init__.py.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan.config import extensions
from titan.config.job_config import opt
from titan.models.args_base import ModelArgsBase
from titan.models.common.attention import Attention
from titan.models.common.aux_loss import attach_aux_loss
from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.hf_adapter import DecoderHFAdapter
from titan.models.common.init import normal
from titan.models.common.pipeline import pipeline_decoder
from titan.models.common.rope import inverse_frequencies, rope_table
from titan.models.spec import TrainSpec, unregister_train_spec

NAME = "gelu_llama"


@dataclass(frozen=True)
class GeluLlamaArgs(ModelArgsBase):
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    # weight of an auxiliary loss on the MLP inputs' mean square (0: none)
    aux_loss_coeff: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        return 4 * self.dim

    def with_updates(self, **kw) -> "GeluLlamaArgs":
        return replace(self, **kw)

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * self.n_heads * hd * 2 + d * self.n_kv_heads * hd * 2
        per_layer = attn + 2 * d * self.ffn_hidden_dim + 2 * d
        total = self.n_layers * per_layer + d + self.vocab_size * d
        return total + (self.vocab_size * d if include_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        return (
            6 * self.num_params(include_embedding=False) + 12 * self.n_layers * self.dim * seq_len
        )


class GeluMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, aux_loss_coeff: float = 0.0):
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden, bias=False)
        self.fc_out = nn.Linear(hidden, dim, bias=False)
        self.aux_loss_coeff = aux_loss_coeff

    def param_inits(self, out_init) -> dict:
        return {"fc_in.weight": normal(0.02), "fc_out.weight": out_init}

    def forward(self, x):
        out = self.fc_out(F.gelu(self.fc_in(x)))
        if self.aux_loss_coeff:
            # of the input, which is whole on every TP rank: the same loss in every layout
            out = attach_aux_loss(out, "activation_l2", self.aux_loss_coeff * x.pow(2).mean())
        return out


class GeluLlama(Decoder):
    # a dataset that gives each token's RoPE position (the example plugin's plugin_corpus:
    # positions within the document) has them passed to forward
    batch_fields = ("positions",)

    def __init__(self, args: GeluLlamaArgs):
        super().__init__(args)
        # counted by this family's post-optimizer hook
        self.register_buffer(
            "optimizer_steps", torch.zeros((), dtype=torch.int64), persistent=False
        )

    def build_block(self, layer_id: int, args: GeluLlamaArgs) -> TransformerBlock:
        return TransformerBlock(
            layer_id,
            args.dim,
            args.norm_eps,
            Attention(args.dim, args.n_heads, args.n_kv_heads, args.head_dim),
            GeluMLP(args.dim, args.ffn_hidden_dim, args.aux_loss_coeff),
        )

    @staticmethod
    def rope_table(args: GeluLlamaArgs, device=None):
        return rope_table(
            inverse_frequencies(args.head_dim, args.rope_theta), args.max_seq_len, device=device
        )

    def init_weights(self, seed: int, buffer_device=None) -> None:
        super().init_weights(seed, buffer_device)
        self.optimizer_steps = torch.zeros((), dtype=torch.int64, device=self.rope.device)


def count_optimizer_steps(parts, job):
    def hook(taken):
        for part in parts:
            part.optimizer_steps += taken

    return hook


@dataclass
class GeluLlamaOptions:
    aux_loss_coeff: float = opt(
        0.0, "Weight of the auxiliary loss on the MLP inputs' mean square (0: none)"
    )


def gelu_mlp_plan(between) -> dict:
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=(between,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.fc_in": ColwiseParallel(),
        "feed_forward.fc_out": RowwiseParallel(output_layouts=between),
    }


def parallelize_gelu_llama(model, dims, job):
    from titan.models.common.parallelize import parallelize_decoder

    return parallelize_decoder(model, dims, job, ffn_plan=gelu_mlp_plan)


class GeluLlamaAdapter(DecoderHFAdapter):
    family = NAME
    hf_model_types = (NAME,)
    interleaved_rope = True
    layer_names = {
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "feed_forward.fc_in.weight": "mlp.fc_in.weight",
        "feed_forward.fc_out.weight": "mlp.fc_out.weight",
    }

    def hf_config(self) -> dict:
        a = self.args
        return {
            "architectures": ["GeluLlamaForCausalLM"],
            "model_type": NAME,
            "hidden_act": "gelu",
            "hidden_size": a.dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "vocab_size": a.vocab_size,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len,
            "tie_word_embeddings": a.tie_word_embeddings,
        }

    @classmethod
    def args_from_hf_config(cls, config: dict, max_seq_len: int | None = None) -> GeluLlamaArgs:
        return GeluLlamaArgs(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=config["num_key_value_heads"],
            vocab_size=config["vocab_size"],
            norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            max_seq_len=max_seq_len or config["max_position_embeddings"],
        )


FLAVORS = {"tiny": GeluLlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2)}


def register() -> None:
    extensions.register(
        TrainSpec(
            name=NAME,
            model_cls=GeluLlama,
            flavors=FLAVORS,
            parallelize_fn=parallelize_gelu_llama,
            pipelining_fn=pipeline_decoder,
            state_dict_adapter=GeluLlamaAdapter,
            post_optimizer_hooks=(count_optimizer_steps,),
            options=GeluLlamaOptions,
        )
    )


def unregister() -> None:
    unregister_train_spec(NAME)
