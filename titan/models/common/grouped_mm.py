"""torch's grouped GEMM (each group of rows times its own matrix), in a form torch.compile can
trace wherever the eager kernel runs.

torch's `_grouped_mm` computes float32 (CPU and CUDA) and bfloat16 on CPU too, but its shape
function (what torch.compile and fake tensors run) accepts bfloat16 only: compiled, such an MoE
block had to fall back to a per-expert loop whose split sizes are read on the host, a graph
break in every MoE block. `titan::grouped_mm` wraps the same kernel as an op with its own shape
function and a backward made of the same kernel calls autograd makes, so compiled and
recomputed products are bitwise the products eager `_grouped_mm` gives
(tests/unit/test_compile_moe.py). Only compiled code takes it, and not for CUDA bfloat16,
which torch's op traces itself; eager calls torch's op directly.

`_grouped_mm` is on none of autocast's lists: under autocast it would compute in the operands'
own dtype (float32 parameters: float32, a slow path on CUDA, or none at all). `grouped_mm`
casts both operands as autocast casts a linear layer's, so an MoE's experts compute in the
autocast dtype like every other matrix product of the model.
"""

import torch
from torch import Tensor


@torch.library.custom_op("titan::grouped_mm", mutates_args=())
def _traced_grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    return torch._grouped_mm(a, b, offs=offsets)


@_traced_grouped_mm.register_fake
def _(a, b, offsets):
    if b.dim() == 3:  # rows grouped: (rows, k) x (groups, k, n)
        return a.new_empty(a.shape[0], b.shape[-1])
    # the inner dimension grouped: (m, rows) x (rows, n) -> one (m, n) per group
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])


def _setup(ctx, inputs, output):
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)


def _backward(ctx, grad):
    # the rows-grouped form's gradient (the only form that is differentiated)
    x, b, offsets = ctx.saved_tensors
    grad_x = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = _traced_grouped_mm(grad, b.transpose(-2, -1), offsets)
    if ctx.needs_input_grad[1]:  # not for a frozen weight (LoRA's base)
        # (grad^T x)^T per group: the order autograd's formula for `_grouped_mm` multiplies in
        grad_b = _traced_grouped_mm(grad.t(), x, offsets).transpose(-2, -1)
    return grad_x, grad_b, None


_traced_grouped_mm.register_autograd(_backward, setup_context=_setup)


def compute_dtype(x: Tensor, b: Tensor) -> torch.dtype | None:
    """The dtype a linear layer of `x` and `b` computes in here: autocast's, where autocast is
    on for their device (it casts every floating operand but float64), else their shared
    dtype; None for two dtypes no linear layer would mix."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (x.dtype, b.dtype):
        return torch.get_autocast_dtype(device)
    return x.dtype if x.dtype == b.dtype else None


def grouped_mm(x: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """x (rows, k) sorted into groups ending at `offsets` (int32, cumulative), b (groups, k, n)
    -> (rows, n): each group's rows times its own matrix, in `compute_dtype`."""
    dtype = compute_dtype(x, b) or x.dtype
    x, b = x.to(dtype), b.to(dtype)
    if torch.compiler.is_compiling() and (x.device.type == "cpu" or dtype != torch.bfloat16):
        return _traced_grouped_mm(x, b, offsets)
    # eager: torch's op itself (the custom op's Python dispatch costs ~0.1 ms a call)
    return torch._grouped_mm(x, b, offs=offsets)
