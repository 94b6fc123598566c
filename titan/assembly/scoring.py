"""Per-position scores of token batches on the training model's parts, whatever their layout:
each target's log-probability and the most likely token, plain and whole on every rank.

What downstream evaluation needs from a model (titan.components.evaluation), and all a
pipeline's last stage or a context-parallel shard can give without gathering the logits:
three numbers a position travel between ranks, not a vocabulary's worth.

Batches are padded on the right (a causal model's earlier positions do not see it) to what the
layout needs: widths divisible by its sequence splits; under context parallelism the RoPE
table's length (it is sharded by place, as the tokens are); under pipelining a few fixed
shapes, one schedule each (a stage infers its shapes once), rows a multiple of the
microbatches.
"""

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan.components.training.loss import target_logprobs


def _packed_scores(logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """(log-probability, most likely token, position) of each (target, position) in `packed`
    (batch, seq, 2), in float64 (token ids and positions exact)."""
    logprobs, top = target_logprobs(logits, packed[..., 0])
    return torch.stack([logprobs.double(), top.double(), packed[..., 1].double()], -1)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class TokenScorer:
    def __init__(self, fwd_bwd):
        self.fb = fwd_bwd
        dims, par = fwd_bwd.plan.dims, fwd_bwd.job.parallelism
        sp = dims.tp_enabled and par.enable_sequence_parallel
        balanced = dims.cp_enabled and par.context_parallel_load_balance
        self.multiple = (dims.tp if sp else 1) * dims.cp * (2 if balanced else 1)
        self.seq_len = fwd_bwd.job.training.seq_len
        self.cp_group = dims["cp"].get_group() if dims.cp_enabled else None
        self.pp_group, self.last_stage_rank = None, None
        if fwd_bwd.pp_plan is not None:
            self.pp_group = dims["pp"].get_group()
            plans = fwd_bwd.plan.pipelines
            self.last_stage_rank = next(
                r for r, p in enumerate(plans) if p.num_stages - 1 in p.stage_ids
            )
        self._schedules: dict[tuple[int, int], object] = {}

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor):
        """(log-probability of each target (float32), most likely token (int64)) at each
        position of (batch, seq) `tokens`; every rank of the layout calls it alike."""
        rows, width = tokens.shape
        n_rows, n_width = self._shape(rows, width)
        pad = (0, n_width - width, 0, n_rows - rows)
        tokens, targets = F.pad(tokens, pad), F.pad(targets, pad)
        positions = torch.arange(n_width, device=tokens.device).expand(n_rows, n_width)
        packed = torch.stack([targets, positions], -1)
        fb = self.fb
        with fb.objective.paused():
            if self.pp_group is not None:
                scores = self._pipeline(tokens, packed)
            else:
                with fb.cp_ctx(tokens, packed), fb.amp():
                    scores = _packed_scores(fb.parts[0](tokens), packed)
        scores = self._whole(scores, n_rows, n_width)[:rows, :width]
        return scores[..., 0].float(), scores[..., 1].long()

    def _shape(self, rows: int, width: int) -> tuple[int, int]:
        if self.cp_group is not None:
            return self._rows(rows), self.seq_len
        if self.pp_group is None:
            return rows, _round_up(width, self.multiple)
        fitted = _round_up(width, self.multiple)
        bucket = _round_up(_pow2(width), self.multiple)
        return self._rows(rows), bucket if bucket <= self.seq_len else fitted

    def _rows(self, rows: int) -> int:
        if self.pp_group is None:
            return rows
        n = self.fb.pp_plan.num_stages  # >= pp ranks, and what V schedules need
        return n * _pow2(-(-rows // n))

    def _pipeline(self, tokens: torch.Tensor, packed: torch.Tensor) -> torch.Tensor | None:
        """The last stage's scores (None on other pipeline ranks)."""
        fb, plan = self.fb, self.fb.pp_plan
        key = tuple(tokens.shape)
        if key not in self._schedules:
            scoring = dataclasses.replace(plan, n_microbatches=plan.num_stages)
            self._schedules[key] = fb._schedule(scoring, _packed_scores)
        has_first, has_last = 0 in plan.stage_ids, plan.num_stages - 1 in plan.stage_ids
        scores = [] if has_last else None
        inputs = tokens if has_first else None
        with fb.cp_ctx(inputs, packed if has_last else None):
            self._schedules[key].eval(
                *((inputs,) if has_first else ()),
                target=packed if has_last else None,
                losses=scores,
                return_outputs=False,
            )
        return torch.cat(scores) if has_last else None

    def _whole(self, scores: torch.Tensor | None, rows: int, width: int) -> torch.Tensor:
        """Every position's scores on every rank: from the last pipeline stage, and from each
        context-parallel rank's part of the sequence (put back by position)."""
        local = width // (dist.get_world_size(self.cp_group) if self.cp_group else 1)
        if self.pp_group is not None:
            if scores is None:
                scores = torch.empty(rows, local, 3, dtype=torch.float64, device=self._device)
            dist.broadcast(scores, group_src=self.last_stage_rank, group=self.pp_group)
        if self.cp_group is None:
            return scores
        parts = [torch.empty_like(scores) for _ in range(dist.get_world_size(self.cp_group))]
        dist.all_gather(parts, scores.contiguous(), group=self.cp_group)
        gathered = torch.cat(parts, dim=1)
        whole = torch.empty(rows, width, 3, dtype=torch.float64, device=gathered.device)
        whole[:, gathered[0, :, 2].long()] = gathered
        return whole

    @property
    def _device(self) -> torch.device:
        return self.fb.device
