"""Chat data: conversations rendered and tokenized exactly as transformers' apply_chat_template
does for the Llama 3, Qwen3 and DeepSeek-V3 formats; the loss counting the assistant's tokens
only; packing, padding, truncation; bad rows named."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from scripts.chat_tokenizer import write_chat_tokenizer
from titan.components.data.chat import ChatOptions, ChatWindows, chat_windows
from titan.components.data.chat_template import ChatTemplate
from titan.components.data.dataset import DataError
from titan.components.data.tokenizer import Tokenizer
from titan.components.training.loss import IGNORE_INDEX

FORMATS = ["llama3", "qwen3", "deepseek_v3"]
CONVERSATIONS = [
    # a system prompt, two turns, text the templates trim
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Who made the light?"},
        {"role": "assistant", "content": "God said, Let there be light."},
        {"role": "user", "content": " And then?  "},
        {"role": "assistant", "content": "And there was light.\n"},
    ],
    # reasoning written into the answer
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nconsider\n</think>\n\nHello there"},
    ],
    # reasoning as its own field, in a later turn; non-ASCII text
    [
        {"role": "user", "content": "Grüße"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "again, ½ more"},
        {"role": "assistant", "content": "two — 二", "reasoning_content": "hmm"},
    ],
    # the same answer text twice: each turn's own tokens are counted
    [
        {"role": "user", "content": "Say yes."},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "yes"},
        {"role": "assistant", "content": "yes"},
    ],
]
# per format and conversation: the text the loss counts (each assistant turn and its end)
COUNTED = {
    "llama3": [
        "God said, Let there be light.<|eot_id|>And there was light.<|eot_id|>",
        "<think>\nconsider\n</think>\n\nHello there<|eot_id|>",
        "one<|eot_id|>two — 二<|eot_id|>",
        "yes<|eot_id|>yes<|eot_id|>",
    ],
    "qwen3": [
        "God said, Let there be light.<|im_end|><think>\n\n</think>\n\nAnd there was light.\n"
        "<|im_end|>",
        "<think>\nconsider\n</think>\n\nHello there<|im_end|>",
        "one<|im_end|><think>\nhmm\n</think>\n\ntwo — 二<|im_end|>",
        "yes<|im_end|><think>\n\n</think>\n\nyes<|im_end|>",
    ],
    "deepseek_v3": [
        "God said, Let there be light.<｜end▁of▁sentence｜>And there was light.\n"
        "<｜end▁of▁sentence｜>",
        "<think>\nconsider\n</think>\n\nHello there<｜end▁of▁sentence｜>",
        "one<｜end▁of▁sentence｜>two — 二<｜end▁of▁sentence｜>",
        "yes<｜end▁of▁sentence｜>yes<｜end▁of▁sentence｜>",
    ],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {fmt: write_chat_tokenizer(root / fmt, fmt) for fmt in FORMATS}


def template(folder) -> ChatTemplate:
    return ChatTemplate.load(Tokenizer(str(folder)))


@pytest.mark.needs("transformers")
@pytest.mark.parametrize("fmt", FORMATS)
def test_ids_equal_transformers(fmt, folders):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(str(folders[fmt]))
    ours = template(folders[fmt])
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ours.render(messages) == hf.apply_chat_template(messages, tokenize=False)
        assert ours.encode(messages)[0] == list(expected)
        prompt = messages[:-1]
        assert ours.render(prompt, add_generation_prompt=True) == hf.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_counted_tokens_are_the_assistant_turns(fmt, folders):
    ours = template(folders[fmt])
    tok = ours.tokenizer
    for messages, expected in zip(CONVERSATIONS, COUNTED[fmt]):
        ids, counted = ours.encode(messages)
        assert tok.decode([i for i, c in zip(ids, counted) if c]) == expected
        # the last turn only: what follows the first turn's end (these have at most two)
        last_ids, last = ours.encode(messages, last_only=True)
        first_end = expected.index(ours.closing) + len(ours.closing)
        assert last_ids == ids
        assert tok.decode([i for i, c in zip(ids, last) if c]) == (
            expected[first_end:] if first_end < len(expected) else expected
        )


def test_generation_blocks_mark_the_tokens(folders):
    """A template with {% generation %} blocks says which text is the assistant's itself."""
    source = (
        "{% for m in messages %}{% if m.role == 'assistant' %}A: {% generation %}"
        "{{ m.content }}<|eot_id|>{% endgeneration %}{% else %}U: {{ m.content }}\n"
        "{% endif %}{% endfor %}"
    )
    tok = Tokenizer(str(folders["llama3"]))
    ours = ChatTemplate(source, tok, {}, "inline")
    messages = CONVERSATIONS[3]
    assert ours.render(messages) == "U: Say yes.\nA: yes<|eot_id|>U: yes\nA: yes<|eot_id|>"
    ids, counted = ours.encode(messages)
    # " yes" is one token, begun by the template's space: it holds the assistant's text
    assert tok.decode([i for i, c in zip(ids, counted) if c]) == " yes<|eot_id|> yes<|eot_id|>"


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_windows_pack_pad_truncate_drop(tmp_path, folders):
    ours = template(folders["llama3"])
    tok = ours.tokenizer
    long = CONVERSATIONS[0] + CONVERSATIONS[0][1:]
    convs = [CONVERSATIONS[1], CONVERSATIONS[3], CONVERSATIONS[2], long]
    files = [write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in convs])]
    lengths = [len(ours.encode(m)[0]) for m in convs]
    seq = lengths[0] + lengths[1]  # the first two share a window, the last is cut
    assert lengths[2] <= seq < lengths[3] and lengths[1] + lengths[2] > seq
    packed = chat_windows(files, ours, ChatOptions(seq_len=seq), tok.pad_id, "c")
    padded = chat_windows(files, ours, ChatOptions(seq_len=seq, pack=False), tok.pad_id, "c")
    dropped = chat_windows(files, ours, ChatOptions(seq_len=seq, truncate=False), tok.pad_id, "c")
    assert (len(packed), len(padded), len(dropped)) == (3, 4, 2)
    # every conversation is whole in its window (but the truncated last), in order
    for windows in (packed, padded, dropped):
        seen = []
        for i in range(len(windows)):
            inputs, labels, docs = windows[i].values()
            assert inputs.dtype == labels.dtype == torch.int64 and docs.dtype == torch.int32
            assert inputs.shape == labels.shape == docs.shape == (seq,)
            for d in docs.unique().tolist():
                run = inputs[docs == d].tolist()
                if run[0] != tok.pad_id:
                    seen.append(run)
        whole = [ours.encode(m)[0] for m in convs[:3]]
        assert seen == (whole if windows is dropped else [*whole, ours.encode(long)[0][:seq]])
    # labels: the next token where it is counted, and never across conversations
    inputs, labels, docs = packed[0].values()
    for start, conv in ((0, convs[0]), (lengths[0], convs[1])):
        ids, counted = ours.encode(conv)
        n = len(ids)
        want = [ids[t + 1] if counted[t + 1] else IGNORE_INDEX for t in range(n - 1)]
        assert labels[start : start + n].tolist() == [*want, IGNORE_INDEX]
        assert inputs[start : start + n].tolist() == ids
    assert docs.tolist() == [0] * lengths[0] + [1] * lengths[1]
    inputs, labels, docs = padded[2].values()
    assert (inputs[lengths[2] :] == tok.pad_id).all() and (labels[lengths[2] - 1 :] == -100).all()
    # the truncated conversation keeps the label of its last place (its next token is known)
    ids, counted = ours.encode(long)
    assert packed[2]["labels"][-1].item() == (ids[seq] if counted[seq] else IGNORE_INDEX)


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"text": "no messages"}, "record 3 has no field 'messages'"),
        ({"messages": "hello"}, "not a list of messages (str)"),
        ({"messages": []}, "not a list of messages (list, empty)"),
        ({"messages": [{"content": "hi"}]}, "message 1 has no role"),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
            "message 2 (assistant) has no text content",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}]},
            "message 2 (assistant) has no text content",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "  "},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "message 1 (user) has empty content",
        ),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ],
)
def test_bad_rows_are_named(record, problem, tmp_path, folders):
    good = {"messages": CONVERSATIONS[1]}
    files = [write_jsonl(tmp_path / "bad.jsonl", [good, good, record])]
    with pytest.raises(DataError) as e:
        chat_windows(files, template(folders["llama3"]), ChatOptions(seq_len=64), 0, "bad")
    msg = str(e.value)
    assert problem in msg and "bad.jsonl: record 3" in msg, msg


def test_a_template_that_drops_the_answer_is_refused(folders, tmp_path):
    tok = Tokenizer(str(folders["llama3"]))
    hides = "{% for m in messages %}{{ m.role }}{% endfor %}"
    with pytest.raises(DataError, match="does not render its content"):
        ChatTemplate(hides, tok, {}, "inline").encode(CONVERSATIONS[1])
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(DataError, match=r"rows.jsonl: conversation 1 .*does not render"):
        chat_windows([rows], ChatTemplate(hides, tok, {}, "inline"), ChatOptions(64), 0, "rows")


def test_missing_template_names_the_fix(tmp_path):
    with pytest.raises(DataError, match="has no chat template.*set chat.template"):
        ChatTemplate.load(Tokenizer("assets/tokenizer/tokenizer.json"))
    with pytest.raises(DataError, match="chat.template = 'nope.jinja': no such file"):
        ChatTemplate.load(Tokenizer("assets/tokenizer/tokenizer.json"), "nope.jinja")


def test_windows_of_nothing_is_an_error():
    with pytest.raises(DataError, match="no conversation that fits"):
        ChatWindows([], 16, 0, True, "empty")


def test_plain_text_encodes_as_with_the_default_tokenizer(folders):
    """A model pretrained with the chat folder reads text as the default tokenizer does."""
    text = (Path("assets/corpus/kjv_valid.jsonl").read_text().splitlines()[0])[:5000]
    plain = Tokenizer("assets/tokenizer/tokenizer.json")
    chat = Tokenizer("assets/tokenizer_chat")
    assert chat.encode(text, eos=False) == plain.encode(text, eos=False)
    assert chat.vocab_size == plain.vocab_size + 3 and chat.bos_id == plain.bos_id
    assert chat.decode([chat.eos_id]) == "<|eot_id|>"  # a document ends as an assistant turn


def test_template_in_tokenizer_config_and_parquet_rows(tmp_path, folders):
    """A folder whose tokenizer_config.json holds the template (older HF folders), and rows
    from parquet: the same ids as the jsonl rows with the folder's own template file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "old_style"
    shutil.copytree(folders["qwen3"], folder)
    source = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": source}))
    ours = template(folder)
    assert ours.where.endswith("tokenizer_config.json's chat_template")
    rows = [
        {"messages": [{"role": m["role"], "content": m["content"]} for m in c]}
        for c in CONVERSATIONS[:2]
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    write_jsonl(tmp_path / "c.jsonl", rows)
    opts = ChatOptions(seq_len=128, pack=False)
    a = chat_windows([tmp_path / "c.parquet"], ours, opts, 0, "parquet")
    b = chat_windows([tmp_path / "c.jsonl"], template(folders["qwen3"]), opts, 0, "jsonl")
    assert len(a) == len(b) == 2
    for i in range(2):
        assert a[i].keys() == b[i].keys()
        assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])
