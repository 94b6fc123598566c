"""titan's model as an lm-evaluation-harness LM: `loglikelihood` (through lm-eval's TemplateLM,
which splits context and continuation as its `hf` backend does), `loglikelihood_rolling` (lm-eval's
rolling windows of the model's length) and greedy `generate_until`.

The model is two callables: `scores(tokens, targets) -> (log-probabilities of the targets, the
most likely tokens)` at each position of a (batch, seq) batch, which any layout gives
(titan.assembly.scoring: pipeline stages and context-parallel shards send those, not logits),
and, where the layout runs one-token steps, `decode(tokens, cache=None) -> logits` for
generation with the decode cache (else each new token re-scores the whole sequence).
Requests are scored in batches of `batch_size`, longest first (right padding: a causal model's
positions before the padding do not see it). With a data-parallel `group`, lm-eval gives each
rank its share of the requests and gathers them through this class.

`lockstep`: the model's forward is itself collective over the group (FSDP's all-gathers), so
every rank must run as many forwards as the others, though their shares need different counts
(rolling windows, generations that stop early): each forward is preceded by a vote over the
group, and a rank with nothing left runs a one-token forward for every peer's until none has.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from titan.components.training.loss import target_logprobs
from titan.models.common.generation import generate


def model_scores(model):
    """`scores` of a model called as model(tokens) -> logits (one process, or TP ranks)."""

    def scores(tokens, targets):
        return target_logprobs(model(tokens), targets)

    return scores


class TitanLM(TemplateLM):
    def __init__(
        self,
        scores,
        tokenizer,
        *,
        max_length: int,
        device: torch.device,
        batch_size: int = 8,
        add_bos_token: bool = True,
        max_gen_toks: int = 256,
        group: dist.ProcessGroup | None = None,
        lockstep: bool = False,
        decode=None,
    ):
        """`scores`, `decode`: the model (above); `tokenizer`: titan's; `add_bos_token`:
        contexts open with BOS, as every document titan trains on does (lm-eval's hf backend:
        its model_args' add_bos_token)."""
        super().__init__()
        self.scores, self.decode = scores, decode
        self.tok, self._device = tokenizer, device
        self._max_length, self._batch_size = max_length, batch_size
        self.add_bos_token, self.max_gen_toks = add_bos_token, max_gen_toks
        self.group = group
        if group is not None:
            self._rank, self._world_size = dist.get_rank(group), dist.get_world_size(group)
        self.lockstep = lockstep and group is not None and self._world_size > 1

    # ---------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tok.bos_id  # what an empty context is

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return list(self.tok.encode(string, bos=bos, eos=False))

    def tok_decode(self, tokens) -> str:
        return self.tok.decode(list(tokens), skip_special=True)

    # ---------------------------------------------------------------- scoring

    @torch.no_grad()
    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, nested: bool = False, **kwargs
    ):
        """(sum of the continuation's log-probabilities, whether it is the greedy one) of each
        (key, context tokens, continuation tokens), its inputs the last max_length tokens."""
        out: list = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -sum(map(len, requests[i][1:])))
        for lo in range(0, len(order), self._batch_size):
            batch = order[lo : lo + self._batch_size]
            inputs, conts = [], []
            for i in batch:
                _, context, continuation = requests[i]
                if len(continuation) > self._max_length:
                    raise ValueError(
                        f"a continuation of {len(continuation)} tokens is longer than the "
                        f"{self._max_length} a request may hold (max_length: the model's "
                        "positions, or the training seq_len in the loop)"
                    )
                inputs.append((context + continuation)[-(self._max_length + 1) :][:-1])
                conts.append(continuation)
            # each row's targets: its next tokens, the continuation's at its end
            targets = [x[1:] + [c[-1]] for x, c in zip(inputs, conts)]
            logprobs, top = self.score(self._padded(inputs), self._padded(targets))
            for row, (i, x, cont) in enumerate(zip(batch, inputs, conts)):
                span = slice(len(x) - len(cont), len(x))
                picked = torch.tensor(cont, device=top.device)
                ll = logprobs[row, span].sum().item()
                out[i] = (ll, bool((top[row, span] == picked).all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        if not nested:
            self.finish()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Each text's log-likelihood over windows of the model's length, each token
        predicted once (lm-eval's rolling windows)."""
        scores = []
        for req in requests:
            (text,) = req.args
            windows = lm_utils.get_rolling_token_windows(
                # encoded as the hf backend does (with add_bos_token, BOS is scored too)
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length,
                context_len=1,
            )
            pieces = [(None, *lm_utils.make_disjoint_window(w)) for w in windows]
            total = sum(ll for ll, _ in self._loglikelihood_tokens(pieces, nested=True))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            scores.append(total)
        self.finish()
        return scores

    def generate_until(self, requests, disable_tqdm: bool = False):
        """Greedy continuations, cut at the first stop string (lm-eval's `until`, EOS
        included); contexts left-truncated to leave room for max_gen_toks."""
        eos = self.tok.decode([self.eot_token_id])
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("titan's lm-eval model generates greedily (do_sample: false)")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos)
            new = kwargs["max_gen_toks"]
            prompt = self.tok_encode(context)[-(self._max_length - new) :]
            tokens = self._greedy(prompt, new)
            text = postprocess_generated_text(
                self.tok_decode(tokens), stop=until, think_end_token=None
            )
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        self.finish()
        return out

    def _padded(self, rows: list[list[int]]) -> torch.Tensor:
        """Right-padded into one batch (a causal model's earlier positions do not see it)."""
        width = max(map(len, rows))
        return torch.tensor([x + [0] * (width - len(x)) for x in rows], device=self._device)

    def _greedy(self, prompt: list[int], new: int) -> list[int]:
        eos = self.eot_token_id
        if self.decode is not None:
            out = generate(
                self._decode, [prompt], max_new_tokens=new, eos_id=eos, device=self._device
            )
            return out[0]
        seq, out = list(prompt), []
        for _ in range(new):
            tokens = self._padded([seq])
            _, top = self.score(tokens, torch.zeros_like(tokens))
            out.append(int(top[0, len(seq) - 1]))
            seq.append(out[-1])
            if out[-1] == eos:
                break
        return out

    # ---------------------------------------------------------------- ranks

    def score(self, tokens: torch.Tensor, targets: torch.Tensor):
        """`scores` of a batch; in lockstep, after the vote, padded to the largest batch of
        the group (a pipeline stage's first batch of a shape runs shape inference, which
        FSDP's all-gathers make collective: every rank of the group runs the same shapes)."""
        if not self.lockstep:
            return self.scores(tokens, targets)
        _, rows, width = self._vote(working=True, shape=tokens.shape)
        pad = (0, width - tokens.shape[1], 0, rows - tokens.shape[0])
        logprobs, top = self.scores(F.pad(tokens, pad), F.pad(targets, pad))
        return logprobs[: tokens.shape[0], : tokens.shape[1]], top[
            : tokens.shape[0], : tokens.shape[1]
        ]

    def _decode(self, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
        """The model's logits of a decode step (plain, whatever the layout), after this
        rank's vote when in lockstep."""
        if self.lockstep:
            self._vote(working=True)  # the peers' forwards: one each, any shape
        out = self.decode(tokens, **kwargs)
        return out.full_tensor() if hasattr(out, "full_tensor") else out

    def finish(self) -> None:
        """In lockstep: forwards of the peers' shapes beside theirs until none has work left."""
        if not self.lockstep:
            return
        while True:
            working, rows, width = self._vote(working=False)
            if not working:
                return
            idle = torch.zeros(rows, width, dtype=torch.long, device=self._device)
            self.scores(idle, idle)

    def _vote(self, working: bool, shape=(1, 1)) -> tuple[bool, int, int]:
        """(whether any rank of the group still works, the largest batch's rows and width
        among those that do); every rank calls it alike."""
        flag = torch.tensor([int(working), *shape], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        working, rows, width = flag.tolist()
        return bool(working), rows, width

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return tensor
        # one row a rank, as accelerate's gather (a scalar is a row of one)
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.group is None:
            return [obj]
        parts = [None] * self._world_size
        dist.all_gather_object(parts, obj, group=self.group)
        return parts if self._rank == dst else None

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)
