"""A titan plugin (`--job.custom_import benchmarks/moe_flavors.py`) adding the shapes the
benchmarks train that titan does not ship:
- torchtitan's Qwen3 makes every layer an MoE layer, so the side-by-side benchmark
  (vs_torchtitan.py) trains the Qwen3-MoE debug shape without its dense first layer;
- benchmarks/scaling.py's MoE curves vary experts and top-k around the Qwen3-MoE debug shape,
  and its checkpoint curve needs larger Llama 3 sizes with the debug vocabulary.
"""

import dataclasses

from titan.models.common.moe_args import MoEArgs
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.qwen3.args import QWEN3_FLAVORS

_MOE = QWEN3_FLAVORS["debugmodel_moe"]

# the qwen3 debugmodel_moe shape, all 4 layers routed (8 experts, top-2, width 128)
QWEN3_FLAVORS["debugmodel_moe_all"] = dataclasses.replace(_MOE, mlp_only_layers=())


def moe_flavor(n_experts: int, top_k: int, hidden: int) -> str:
    """The debug MoE shape with these routed experts (registered on first use)."""
    name = f"moe_e{n_experts}_k{top_k}_h{hidden}"
    if name not in QWEN3_FLAVORS:
        QWEN3_FLAVORS[name] = dataclasses.replace(
            _MOE, moe=MoEArgs(n_experts=n_experts, top_k=top_k, hidden_dim=hidden)
        )
    return name


# scaling.py's series: top-k x width fixed at 256 (equal active parameters); the first also
# at equal total (experts x width 1024), the second adding experts at width 128
GRANULARITY = [(4, 1, 256), (8, 2, 128), (16, 4, 64), (32, 8, 32)]
EXPERT_COUNT = [(4, 2, 128), (8, 2, 128), (16, 2, 128), (32, 2, 128), (64, 2, 128)]
for shape in GRANULARITY + EXPERT_COUNT:
    moe_flavor(*shape)

# ~170M and ~530M parameters with the debug vocabulary: the checkpoint curve's larger sizes
# (fp32 AdamW training of 1B, 19 GiB of state, does not fit this 24 GiB machine beside a save)
LLAMA3_FLAVORS["scaling_170M"] = Llama3Args(
    dim=1024, n_layers=14, n_heads=16, n_kv_heads=8, vocab_size=2048, multiple_of=256
)
LLAMA3_FLAVORS["scaling_530M"] = Llama3Args(
    dim=1536, n_layers=20, n_heads=16, n_kv_heads=8, vocab_size=2048, multiple_of=256
)
