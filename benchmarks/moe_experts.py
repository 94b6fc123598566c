"""The routed experts alone, forward + backward, by the way they compute: torch's grouped GEMM
under bf16 autocast with fp32 parameters (what a one-GPU titan run does), the per-expert loop
under the same autocast (what it did before the grouped GEMM took autocast), and in float32
the grouped GEMM (where torch runs it) and the loop. Also how many times one forward + backward
waits for the host (CUDA: `torch.cuda.set_sync_debug_mode`; it counts the loop's split sizes).

    python benchmarks/moe_experts.py                 # GPU: Moonlight-16B-A3B's and Qwen3-30B-A3B's
                                                     # experts, 8192 tokens
    python benchmarks/moe_experts.py --device cpu --tiny

Prints a table: milliseconds per forward + backward (median of --iters after 3 warm-ups),
TFLOP/s of the experts' 6 GEMMs x 3 (forward and backward), and the host waits.
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import titan.models.common.moe as moe_module  # noqa: E402
from titan.models.common.moe import GroupedExperts  # noqa: E402

# (name, dim, hidden, experts, k): the experts of the GPU suite's two MoE shapes
SHAPES = {
    "Moonlight-16B-A3B": (2048, 1408, 64, 6),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
}
TINY = {"debug": (256, 128, 8, 2)}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(experts, x, counts, grad, autocast, grouped, iters) -> tuple[float, int | None]:
    """(median ms of forward + backward, host waits of one of them on CUDA)."""
    device = x.device
    ctx = (
        (lambda: torch.autocast(device.type, torch.bfloat16))
        if autocast
        else (lambda: torch.autocast(device.type, enabled=False))
    )
    # the path measured, whatever titan would pick
    with mock.patch.object(moe_module, "_grouped_mm_fits", lambda x, w: grouped):

        def once():
            with ctx():
                out = experts(x, counts)
            out.backward(grad.to(out.dtype))

        for _ in range(3):
            once()
        times = []
        for _ in range(iters):
            _sync(device)
            t0 = time.perf_counter()
            once()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        waits = None
        if device.type == "cuda":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    once()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            waits = sum("synchroniz" in str(w.message) for w in caught)
        return statistics.median(times), waits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a debug-sized layer (the code path)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens (default 8192; tiny 256)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    tokens = args.tokens or (256 if args.tiny else 8192)
    print(
        f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
        f"torch {torch.__version__}, {tokens} tokens"
    )
    print("| experts | compute | path | ms fwd+bwd | TFLOP/s | host waits |")
    print("|---|---|---|---|---|---|")
    for name, (dim, hidden, n, k) in (TINY if args.tiny else SHAPES).items():
        torch.manual_seed(0)
        experts = GroupedExperts(dim, hidden, n).to(device)
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.02)
        rows = tokens * k
        # an uneven routing, as a real router's: expert loads from a skewed draw
        choice = torch.multinomial(torch.linspace(1, 3, n), rows, replacement=True)
        counts = torch.bincount(choice, minlength=n).to(device)
        x = torch.randn(rows, dim, device=device, requires_grad=True)
        grad = torch.randn(rows, dim, device=device)
        flops = 3 * 2 * rows * dim * hidden * 3
        for label, autocast, grouped in (
            ("bf16 autocast", True, True),
            ("bf16 autocast", True, False),
            ("fp32", False, True),
            ("fp32", False, False),
        ):
            path = "grouped GEMM" if grouped else "per-expert loop"
            dtype = torch.bfloat16 if autocast else torch.float32
            if grouped and not moe_module._grouped_mm_fits(x.to(dtype), experts.w1.to(dtype)):
                try:  # titan does not take it here: is there a kernel at all?
                    offs = torch.tensor([8], device=device, dtype=torch.int32)
                    w = experts.w1.detach()[:1].transpose(-2, -1).to(dtype)
                    torch._grouped_mm(x.detach()[:8].to(dtype), w, offs=offs)
                    path += " (titan takes the loop)"
                except RuntimeError as e:
                    print(f"| {name} | {label} | {path} | no kernel: {str(e)[:60]} | | |")
                    continue
            ms, waits = measure(experts, x, counts, grad, autocast, grouped, args.iters)
            experts.zero_grad(set_to_none=True)
            x.grad = None
            tf = flops / (ms / 1e3) / 1e12
            print(
                f"| {name} | {label} | {path} | {ms:.2f} | {tf:.1f} | "
                f"{'n/a' if waits is None else waits} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
