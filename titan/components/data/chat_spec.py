"""Chat data's [chat] section and checks (`training.dataset_format = "chat"`), registered as
every component's are; torch-free (the data are titan.components.data.chat)."""

from dataclasses import dataclass
from typing import Literal

from titan.config.entry import Entry, register
from titan.config.job_config import opt


@dataclass
class Chat:
    messages_field: str = opt(
        "messages", "Column holding each conversation: a list of {role, content} messages"
    )
    template: str = opt(
        "",
        "Jinja chat template file; empty = the tokenizer folder's (chat_template.jinja, or "
        "tokenizer_config.json's chat_template)",
    )
    loss_on: Literal["assistant", "last_assistant"] = opt(
        "assistant", "Tokens the loss counts: every assistant turn, or only the last one"
    )
    packing: Literal["pack", "pad"] = opt(
        "pack",
        "pack: conversations share a window, each seeing only itself (needs model."
        "attn_mask_type = block_causal); pad: one conversation a window, padded",
    )
    overlong: Literal["truncate", "drop"] = opt(
        "truncate", "A conversation longer than training.seq_len: cut at seq_len, or skipped"
    )


def check(job) -> None:
    """Conversations: read whole and indexed, from one source, and, packed, under a mask that
    keeps each to itself."""
    from titan.config.manager import require

    t = job.training
    if t.dataset_format != "chat":
        return
    for key, ok, why in (
        ("training.dataset_mix", not t.dataset_mix, "mixes text sources; chat data is one source"),
        (
            "training.dataset_streaming",
            not t.dataset_streaming,
            "chat data is read whole into windows (they resume on any layout); unset it",
        ),
        (
            "fault_tolerance.enable",
            not job.fault_tolerance.enable,
            "with chat data the loss is a mean over the counted tokens of the whole batch, "
            "which torchft's replica groups do not share; disable one of the two",
        ),
    ):
        require(job, ok, key, why)
    require(
        job,
        job.chat.packing == "pad" or job.model.attn_mask_type == "block_causal",
        "chat.packing",
        "packed conversations would attend to each other: set model.attn_mask_type = "
        '"block_causal", or chat.packing = "pad"',
    )


def check_template(job, tokenizer) -> None:
    """A template to render the conversations with, once the tokenizer is loaded."""
    if job.training.dataset_format != "chat" or tokenizer is None:
        return
    from titan.components.data.chat_template import ChatTemplate
    from titan.components.data.dataset import DataError
    from titan.config import ConfigError

    try:
        ChatTemplate.load(tokenizer, job.chat.template)
    except DataError as e:
        raise ConfigError(f"training.dataset_format = 'chat': {e}") from None


def check_model(job, plan) -> None:
    """A model that reads tokens from the labels cannot train on a chat's masked ones."""
    from titan.config import ConfigError

    why = plan.model_args.masked_labels_problem()
    if job.training.dataset_format == "chat" and why:
        raise ConfigError(f"training.dataset_format = 'chat' with {job.model.name} {why}")


def plan_check(job, plan) -> None:
    check_template(job, plan.tokenizer)
    check_model(job, plan)


register(Entry("chat", section="chat", options=Chat, check=check, plan_check=plan_check))
