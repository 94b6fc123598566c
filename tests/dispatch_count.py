"""Counting what a piece of eager code asks of torch: aten ops by name, and the reads that make
the host wait for the device (a value copied out of a tensor, or an op whose output size
depends on the values)."""

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops whose kernel reads tensor values on the host: on CUDA each is a synchronization
HOST_READS = {
    aten._local_scalar_dense,  # .item(), float(t), bool(t), int(t)
    aten.nonzero,  # without a size (nonzero_static has one)
    aten.masked_select,
    aten.bincount,
    aten._unique,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
    aten.equal,
}


def _reads_host(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet in HOST_READS:
        return True
    if packet is aten.repeat_interleave:  # sums its repeats unless told the output size
        return func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
    if packet is aten.index:  # boolean-mask indexing is nonzero underneath
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    return False


class DispatchCount(TorchDispatchMode):
    """Within: `ops` counts every op by its qualified name (`aten._grouped_mm`,
    `titan.cp_all_to_all`: all overloads together); `host_reads` lists the ones that read
    values on the host, and `tolist` counts Tensor.tolist calls (which copy without an op)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.host_reads: list[str] = []
        self.tolist = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func.overloadpacket)] += 1
        if _reads_host(func, args, kwargs):
            self.host_reads.append(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        original = self._original = torch.Tensor.tolist

        def tolist(t):
            self.tolist += 1
            return original(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._original
        return super().__exit__(*exc)
