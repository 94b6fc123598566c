"""The SwiGLU feed-forward network of Llama, Qwen and DeepSeek's dense layers."""

import torch
import torch.nn.functional as F
from torch import nn

from titan.models.common.init import normal


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def param_inits(self, out_init) -> dict:
        # w3 too: it scales what w2 writes into the residual stream
        return {"w1.weight": normal(0.02), "w2.weight": out_init, "w3.weight": out_init}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
