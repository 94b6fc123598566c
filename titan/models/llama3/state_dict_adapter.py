"""Map titan's Llama 3 state dict to and from the HF `LlamaForCausalLM` layout.

titan rotates interleaved pairs (Meta's layout); HF rotates the two halves of each head,
so q/k projection rows are permuted on the way across.
"""

import re

import torch

from titan.models.llama3.args import Llama3Args

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TITAN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class Llama3StateDictAdapter:
    def __init__(self, args: Llama3Args):
        self.args = args
        self._heads = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.kv_heads}

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state_dict.items():
            m = _TITAN_LAYER.match(name)
            if m is None:
                if name not in _TOP:
                    raise KeyError(f"no HF name for titan parameter {name!r}")
                out[_TOP[name]] = t
                continue
            layer, rest = m.groups()
            if rest not in _LAYER:
                raise KeyError(f"no HF name for titan parameter {name!r}")
            if rest in self._heads:
                t = _interleaved_to_halves(t, self._heads[rest])
            out[f"model.layers.{layer}.{_LAYER[rest]}"] = t
        return out

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        top = {v: k for k, v in _TOP.items()}
        layer_map = {v: k for k, v in _LAYER.items()}
        out = {}
        for name, t in hf_state_dict.items():
            if "rotary_emb" in name:
                continue  # HF may store inv_freq; titan recomputes it
            m = _HF_LAYER.match(name)
            if m is None:
                if name not in top:
                    raise KeyError(f"unexpected HF parameter {name!r} for a Llama 3 model")
                out[top[name]] = t
                continue
            layer, rest = m.groups()
            if rest not in layer_map:
                raise KeyError(f"unexpected HF parameter {name!r} for a Llama 3 model")
            titan_name = layer_map[rest]
            if titan_name in self._heads:
                t = _halves_to_interleaved(t, self._heads[titan_name])
            out[f"layers.{layer}.{titan_name}"] = t
        return out

    def hf_config(self) -> dict:
        a = self.args
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": a.dim, "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
            "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": False,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if a.rope_scaling_factor is not None:
            cfg["rope_scaling"] = {
                "rope_type": "llama3", "factor": a.rope_scaling_factor,
                "low_freq_factor": a.rope_low_freq_factor,
                "high_freq_factor": a.rope_high_freq_factor,
                "original_max_position_embeddings": a.rope_original_max_len,
            }
        return cfg
