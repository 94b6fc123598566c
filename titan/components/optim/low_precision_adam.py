"""Adam/AdamW whose moment estimates (exp_avg, exp_avg_sq) are kept in bfloat16 between steps.

The update itself is torch's (its fused / foreach / for-loop kernels, on plain tensors and on
DTensors alike), run in float32: a chunk of parameters at a time, the moments are upcast,
updated with the parameters, and rounded back. Optimizer state memory halves; the float32
copies live only for one chunk (`chunk_numel` elements) at a time. Its state and update
(`adam_state`, `adam_update`) serve Muon's AdamW half too.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _chunks(params: list[torch.Tensor], limit: int):
    chunk, size = [], 0
    for p in params:
        if chunk and size + p.numel() > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


def adam_state(state: dict, p: torch.Tensor, moment_dtype: torch.dtype, fused: bool) -> dict:
    """`state` (a parameter's optimizer state) with Adam's entries, made on first use as
    torch's Adam makes them: a float32 step count on the CPU (on the device for fused), the
    moments in `moment_dtype`."""
    if not state:
        device = p.device if fused else "cpu"
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=device)
        for name in _MOMENTS:
            state[name] = torch.zeros_like(
                p, dtype=moment_dtype, memory_format=torch.preserve_format
            )
    return state


def adam_update(
    params, exp_avgs, exp_avg_sqs, steps, group: dict, *, implementation: str, decoupled: bool
) -> None:
    """torch's Adam/AdamW update of `params` with the hyper-parameters of their `group`."""
    beta1, beta2 = group["betas"]
    adam(
        params,
        [p.grad for p in params],
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=implementation == "foreach",
        fused=implementation == "fused",
        decoupled_weight_decay=decoupled,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


class LowPrecisionStateAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        decoupled_weight_decay: bool,
        state_dtype: torch.dtype = torch.bfloat16,
        implementation: str = "foreach",
        chunk_numel: int = 2**26,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.decoupled = decoupled_weight_decay
        self.state_dtype = state_dtype
        self.implementation = implementation
        self.chunk_numel = chunk_numel

    def _state(self, p: torch.Tensor) -> dict:
        return adam_state(self.state[p], p, self.state_dtype, self.implementation == "fused")

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        # torch casts loaded state to its parameter's dtype: the moments would stay float32
        # (twice the memory, and updates no longer rounded as before the checkpoint)
        for state in self.state.values():
            for name in _MOMENTS:
                if name in state and state[name].dtype != self.state_dtype:
                    state[name] = state[name].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for chunk in _chunks(params, self.chunk_numel):
                states = [self._state(p) for p in chunk]
                moments = {n: [s[n].float() for s in states] for n in _MOMENTS}
                adam_update(
                    chunk,
                    moments["exp_avg"],
                    moments["exp_avg_sq"],
                    [s["step"] for s in states],
                    group,
                    implementation=self.implementation,
                    decoupled=self.decoupled,
                )
                for n in _MOMENTS:
                    for s, m in zip(states, moments[n], strict=True):
                        s[n].copy_(m)
        return loss
