"""The [debug] section: fault injection for titan's own tests (NaN losses, corrupted batches,
slow, hung or killed ranks), listed by --help apart from the options of real runs; torch-free
(the injector is injection.py)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class Debug:
    nan_at_step: int = opt(
        -1, "Test hook: make the model's output, so the loss, NaN at this step (-1 = never)"
    )
    bad_batch_at_step: int = opt(
        -1,
        "Test hook: make this step's batch one token repeated (the vocabulary's last), so "
        "its loss and gradients spike as a corrupted batch's would (-1 = never)",
    )
    bad_document_at_step: int = opt(
        -1,
        "Test hook: at this step, the document that sample debug.bad_document_sample of the "
        "global batch opens with has its tokens in that window made the vocabulary's last "
        "id, as a corrupted document's would be (-1 = never)",
    )
    bad_document_sample: int = opt(0, "Test hook: the sample of debug.bad_document_at_step")
    perturb_grads_at_step: int = opt(
        -1,
        "Test hook: debug.perturb_rank multiplies the gradients it holds by 100 once, in this "
        "step's first pass, as a faulty device would (-1 = never)",
    )
    perturb_rank: int = opt(
        0, "Test hook: the rank whose gradients debug.perturb_grads_at_step perturbs"
    )
    sleep_at_step: int = opt(-1, "Test hook: debug.sleep_rank sleeps inside this step (-1 = never)")
    sleep_rank: int = opt(0, "Test hook: the rank that sleeps at debug.sleep_at_step")
    sleep_seconds: float = opt(3600.0, "Test hook: how long that rank sleeps")
    sleep_every_step: bool = opt(
        False, "Test hook: sleep in every step from debug.sleep_at_step on (a straggler)"
    )
    kill_in_checkpoint_step: int = opt(
        -1,
        "Test hook: debug.kill_rank SIGKILLs itself while saving this step's checkpoint, "
        "on the first launch only (-1 = never)",
    )
    kill_in_checkpoint_phase: Literal["written", "writing"] = opt(
        "written",
        "Test hook: when it dies: its files written, before the save is marked "
        "complete; or as it starts writing them (a synchronous save), peers mid-save",
    )
    kill_rank: int = opt(0, "Test hook: the rank killed by debug.kill_in_checkpoint_step")


register(Entry("debug", section="debug", options=Debug))
