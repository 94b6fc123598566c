"""A model's chat template: conversations rendered as transformers' `apply_chat_template`
renders them, tokenized as it tokenizes them, and which of the tokens are the assistant's.

The environment is transformers' (a sandbox with trim_blocks and lstrip_blocks, loop controls,
its `tojson`, `raise_exception` and `strftime_now`, the tokenizer's special tokens as
variables), so a template renders to the same text and the text to the same ids.

An assistant turn's tokens run from the end of the header that opens it (the text the template
adds for `add_generation_prompt`) to the end of the marker that closes it (`<|eot_id|>`,
`<|im_end|>`, ...): what the model must write when it is prompted. Templates that mark those
tokens themselves with `{% generation %}` blocks are taken at their word instead.
"""

import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from titan.components.data.dataset import DataError
from titan.components.data.tokenizer import Tokenizer
from titan.runtime.paths import resolve

# the special-token names transformers passes to a template as variables
_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# marks a `{% generation %}` block's ends in the rendered text; no template writes them
_OPEN, _CLOSE = "\x00<generation>\x00", "\x00</generation>\x00"
_PROBE_USER, _PROBE_ASSISTANT = "titan probe question", "titan probe answer"


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: the assistant's text, marked."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller) -> str:
        return _OPEN + caller() + _CLOSE


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # unlike jinja's own filter, no HTML escaping (as transformers)
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def find_template(folder: Path) -> tuple[str, str] | None:
    """(template, where it was found) in an HF tokenizer folder, as transformers looks:
    chat_template.jinja, else tokenizer_config.json's chat_template (a named set's
    "default"); None when the folder has none."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(), str(file)
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return (template, f"{config}'s chat_template") if isinstance(template, str) else None


def special_tokens(folder: Path) -> dict[str, str]:
    """The tokenizer folder's special tokens as template variables (bos_token, ...)."""
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return {}
    values = json.loads(config.read_text())
    found = {key: _token_text(values.get(key)) for key in _SPECIAL_KEYS}
    return {key: text for key, text in found.items() if isinstance(text, str)}


class ChatTemplate:
    def __init__(self, source: str, tokenizer: Tokenizer, variables: dict, where: str):
        self.tokenizer, self.variables, self.where = tokenizer, variables, where
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:
            raise DataError(f"the chat template {where} is not valid jinja: {e}") from None
        self._marked = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None
        self.header, self.closing = self._turn_markers()

    @classmethod
    def load(cls, tokenizer: Tokenizer, path: str = "") -> "ChatTemplate":
        """The template of `path` (a jinja file), else of the tokenizer's folder."""
        folder = tokenizer.path.parent
        if path:
            file = resolve(path)
            if not file.is_file():
                raise DataError(f"chat.template = {path!r}: no such file; fix the path")
            found = (file.read_text(), str(file))
        else:
            found = find_template(folder)
        if found is None:
            raise DataError(
                f"the tokenizer folder {folder} has no chat template (chat_template.jinja or "
                "tokenizer_config.json's chat_template); set chat.template to a jinja file, or "
                "use a model folder that ships one"
            )
        return cls(found[0], tokenizer, special_tokens(folder), found[1])

    def _probe(self) -> list[dict]:
        return [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ASSISTANT},
        ]

    def _render_raw(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.variables,
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text `apply_chat_template(messages, tokenize=False)` returns."""
        text = self._render_raw(_plain(messages), add_generation_prompt)
        return text.replace(_OPEN, "").replace(_CLOSE, "") if self._marked else text

    def _turn_markers(self) -> tuple[str, str]:
        """(the header that opens an assistant turn, the marker that closes one), from
        rendering a probe conversation: what add_generation_prompt appends, and what
        follows the assistant's text."""
        try:
            question = self.render(self._probe()[:1])
            prompted = self.render(self._probe()[:1], add_generation_prompt=True)
            answered = self.render(self._probe())
        except jinja2.TemplateError as e:
            raise DataError(
                f"the chat template {self.where} cannot render a user turn and an assistant "
                f"turn: {e}"
            ) from None
        header = prompted[len(question) :] if prompted.startswith(question) else ""
        at = answered.rfind(_PROBE_ASSISTANT)
        closing = answered[at + len(_PROBE_ASSISTANT) :].strip() if at >= 0 else ""
        return header, closing

    def encode(self, messages: list[dict], last_only: bool = False) -> tuple[list[int], list[bool]]:
        """(the conversation's token ids, which of them the loss counts: the assistant's)."""
        raw = self._render_raw(_plain(messages))
        if self._marked:
            text, spans = _strip_marks(raw)
        else:
            text = raw
            spans = self._assistant_spans(text, messages)
        if last_only:
            spans = spans[-1:]
        ids, offsets = self.tokenizer.encode_with_offsets(text)
        # a token that holds any of the assistant's text is the assistant's (transformers'
        # assistant mask alike): a word's token that starts with the space before it
        counted = [any(a < e and b > s for s, e in spans) for a, b in offsets]
        return ids, counted

    def _assistant_spans(self, text: str, messages: list[dict]) -> list[tuple[int, int]]:
        """Where each assistant turn's text lies in `text`: found in message order, each
        search starting past the previous message's content."""
        cursor, spans = 0, []
        for i, message in enumerate(messages):
            content = _text_of(message["content"])
            # templates may trim a message, or keep only the answer after a reasoning block
            needles = [content.strip(), content.rpartition("</think>")[2].strip()]
            pos, needle = next(
                ((text.find(n, cursor), n) for n in needles if n and text.find(n, cursor) >= 0),
                (-1, ""),
            )
            if message["role"] != "assistant":
                cursor = pos + len(needle) if pos >= 0 else cursor
                continue
            if pos < 0:
                raise DataError(
                    f"message {i + 1} (assistant): the chat template {self.where} does not render "
                    "its content as given, so its tokens cannot be found"
                )
            head = text.rfind(self.header, cursor, pos) if self.header else -1
            start = head + len(self.header) if head >= 0 else pos
            end = pos + len(needle)
            after = len(text[end:]) - len(text[end:].lstrip())
            if self.closing and text.startswith(self.closing, end + after):
                end += after + len(self.closing)
            spans.append((start, end))
            cursor = end
        return spans


def _text_of(content) -> str:
    """A message's text: its content, or the last text part of content given as parts (an
    image's part renders as the template's placeholder, between the text parts)."""
    if isinstance(content, str):
        return content
    texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return texts[-1] if texts else ""


def _plain(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys set to None dropped, reasoning
    under each of its names."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _strip_marks(raw: str) -> tuple[str, list[tuple[int, int]]]:
    """(the text without generation marks, the spans they enclosed)."""
    text, spans, at = [], [], 0
    length = 0
    while True:
        i = raw.find(_OPEN, at)
        if i < 0:
            text.append(raw[at:])
            return "".join(text), spans
        j = raw.find(_CLOSE, i)
        text.append(raw[at:i])
        length += i - at
        inner = raw[i + len(_OPEN) : j]
        text.append(inner)
        spans.append((length, length + len(inner)))
        length += len(inner)
        at = j + len(_CLOSE)
