"""Cut one pipeline stage out of a whole (meta-device) `Decoder`.

Stages keep the original parameter names (layers not in a stage are deleted, embedding/head
set to None and skipped in forward), so weight init, checkpoints and HF conversion see the
same names in every layout.
"""

import copy

from torch import nn

from titan.parallelisms.pipeline import PipelinePlan


def pipeline_decoder(whole: nn.Module, stage_id: int, plan: PipelinePlan) -> nn.Module:
    """The plan's blocks of the main stack; the last stage also the blocks past it (a family's
    `head` runs them after the final norm: DeepSeek-V3's multi-token prediction)."""
    stage = copy.deepcopy(whole)
    last = stage_id == plan.num_stages - 1
    keep = {str(i) for i in plan.layer_ranges[stage_id]}
    for name in list(stage.layers.keys()):
        if name not in keep and not (last and int(name) >= whole.args.n_layers):
            del stage.layers[name]
    if stage_id != 0:
        for name in stage.input_parts:
            setattr(stage, name, None)
    if not last:
        stage.norm = None
        stage.output = None
    return stage
