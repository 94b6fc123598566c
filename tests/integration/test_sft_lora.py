"""The fine-tuning workflow end to end: a small HF model (transformers wrote it) fine-tuned with
LoRA on the bundled chat corpus, its final export merged and beside it a PEFT adapter that peft
loads onto the base to the merged model's logits, and `titan.tools.generate --chat` answering
from the export with the chat template."""

import shutil
import sys

import pytest
import torch

from tests.forked import run_trainer, tiny_run
from tests.unit.test_chat_training import CHAT
from tests.unit.test_lora import load_hf
from titan.runtime.paths import REPO_ROOT

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="needs fork"),
    pytest.mark.needs("transformers", "peft"),
]
STEPS = 12


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("sft_lora")
    base = root / "base"
    config = transformers.LlamaConfig(
        vocab_size=2051,  # the bundled chat tokenizer's
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(base))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(REPO_ROOT / "assets/tokenizer_chat" / name, base / name)
    argv = [
        *tiny_run(STEPS),
        *CHAT,
        "--model.flavor",
        "from_hf",
        "--model.tokenizer_path",
        str(base),
        "--checkpoint.initial_load_path",
        str(base),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "100",
        "--checkpoint.last_save_in_hf",
        "--lora.rank",
        "8",
        "--optimizer.lr",
        "2e-2",
    ]
    records = run_trainer(root, 2, [*argv, "--parallelism.data_parallel_shard_degree", "2"])
    return records, base, root / "dump" / "checkpoint" / f"step-{STEPS}"


def test_fine_tuning_lowers_the_loss(finetuned):
    records, _, _ = finetuned
    assert len(records) == STEPS
    assert records[-1]["loss"] < records[0]["loss"] - 0.1, [r["loss"] for r in records]


def test_peft_adapter_on_the_base_is_the_merged_export(finetuned):
    import peft

    _, base, export = finetuned
    assert (export / "adapter" / "adapter_model.safetensors").is_file()
    tokens = torch.randint(0, 2051, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = load_hf(export)(tokens).logits
        adapted = peft.PeftModel.from_pretrained(load_hf(base), str(export / "adapter"))(tokens)
        plain = load_hf(base)(tokens).logits
    torch.testing.assert_close(adapted.logits, merged, rtol=0, atol=1e-4)
    assert (plain - merged).abs().max() > 1e-3  # the fine-tuning changed the model
    # the adapter is a small fraction of the model
    size = (export / "adapter" / "adapter_model.safetensors").stat().st_size
    assert size < (export / "model.safetensors").stat().st_size / 10


def test_generate_answers_in_the_chat_template(finetuned, capsys):
    import transformers

    from titan.components.data.tokenizer import Tokenizer
    from titan.tools.generate import chat_prompts, main

    _, _, export = finetuned
    question = "What does Genesis 1:3 say?"
    hf = transformers.AutoTokenizer.from_pretrained(str(export))
    expected = hf.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )
    assert chat_prompts(Tokenizer(str(export)), [question], None) == [list(expected)]
    main(["--checkpoint", str(export), "--chat", "--prompt", question, "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert out.strip() and question not in out  # the answer, not the prompt echoed
