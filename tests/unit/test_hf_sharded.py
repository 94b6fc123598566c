"""HF folders read and written by every rank from its own shards (DCP's HF storage), on
forked ranks running the real Trainer: a resharded FSDP 4 load reads a quarter of the bytes
and holds no full model; exports from TP / PP / FSDP layouts equal the one-process model
bit for bit; the final save of a run is an HF folder that HF tooling reads as is."""

import json
import sys
import threading
import time

import pytest
import torch

from tests.forked import build_trainer, free_port, run_trainer, run_workers
from tests.layouts import degrees, layouts
from titan.components.checkpoint import folders as checkpoint
from titan.components.checkpoint import hf_io
from titan.models.llama3.args import Llama3Args
from titan.models.spec import get_train_spec

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs fork")

LLAMA = get_train_spec("llama3")
# big enough that a whole model (109 MB in fp32) stands out of the allocator's noise
WIDE = Llama3Args(
    dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=2048, multiple_of=256, max_seq_len=32
)
BASE = [
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "4",
    "--training.mixed_precision_param",
    "float32",
    "--training.steps",
    "1",
    "--metrics.no_enable_tensorboard",
    "--metrics.peak_flops",
    "1e12",
]


def seeded_state(args, seed=0) -> dict[str, torch.Tensor]:
    model = LLAMA.build_meta(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.state_dict()


def full_state(trainer) -> dict[str, torch.Tensor]:
    """Every rank's parameters, gathered (DTensors) and merged over pipeline stages."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    # the live parameters, a pipeline's tied copy included (a ModelState saves it once)
    own = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for part in trainer.model_parts
        for k, v in get_model_state_dict(part).items()
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    return {k: v for part in every for k, v in part.items()}


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


class PeakRss:
    """The highest anonymous resident memory while the block runs, sampled every ms."""

    def __enter__(self):
        self.base = self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def growth(self) -> int:
        return self.peak - self.base


# ----------------------------------------------------------------------------- sharded load


def _load_wide(rank, world_size, port, argv, tokens):
    measured = {}
    load_into = hf_io.HFModelIO.load_into

    def measure(self, state, path):
        with PeakRss() as rss:
            out = load_into(self, state, path)
        measured.update(growth=rss.growth, bytes_read=out[1])
        return out

    hf_io.HFModelIO.load_into = measure
    trainer = build_trainer(rank, world_size, port, argv)
    with torch.no_grad():
        logits = trainer.model_parts[0](tokens)
    trainer.close()
    return {**measured, "logits": logits if rank == 0 else None}


def test_fsdp4_loads_its_quarter_of_an_hf_folder(tmp_path):
    reference = seeded_state(WIDE, seed=3)
    hf_dir = hf_io.save_hf(reference, LLAMA, WIDE, tmp_path / "hf", max_shard_size="30MB")
    assert len(json.loads((hf_dir / hf_io.HF_INDEX_FILE).read_text())["weight_map"]) == len(
        reference
    )
    model_bytes = sum(t.numel() * 4 for t in reference.values())
    tokens = torch.randint(0, WIDE.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))

    # no checkpoint.enable: the initial load happens whenever a path is given
    argv = [
        *BASE,
        "--model.flavor",
        "from_hf",
        "--checkpoint.initial_load_path",
        str(hf_dir),
        "--checkpoint.initial_load_in_hf",
        "--parallelism.data_parallel_shard_degree",
        "4",
        "--job.dump_folder",
        str(tmp_path / "dump"),
    ]
    ranks = run_workers(
        _load_wide, 4, tmp_path, free_port(), argv, tokens, init_pg=False, deadline_s=120
    )

    # every byte of the folder is read once, by the rank that holds it
    assert sum(r["bytes_read"] for r in ranks) == model_bytes
    for r in ranks:
        assert r["bytes_read"] <= model_bytes / 4 * 1.05, r["bytes_read"]
        # no rank ever holds the whole model: it grows by about its quarter (27 MB), far
        # from the 109 MB of the whole
        assert r["growth"] < 0.5 * model_bytes, (r["growth"], model_bytes)
    print(
        "model",
        model_bytes / 2**20,
        "MiB; per-rank read",
        [round(r["bytes_read"] / 2**20, 1) for r in ranks],
        "MiB; per-rank RSS growth",
        [round(r["growth"] / 2**20, 1) for r in ranks],
        "MiB",
    )

    whole = LLAMA.build_meta(WIDE)
    whole.to_empty(device="cpu")
    whole.init_weights(0)  # builds the RoPE table, which no state dict holds
    whole.load_state_dict(reference)
    with torch.no_grad():
        expected = whole(tokens)
    torch.testing.assert_close(ranks[0]["logits"], expected, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- round trips


def round_trip(rank, world_size, port, argv, out_dir, dtype):
    """Export this layout's model, forget it, read it back: (bytes this rank read, the whole
    state on rank 0)."""
    from titan.components.checkpoint.train_state import ModelState

    trainer = build_trainer(rank, world_size, port, argv)
    model = ModelState(trainer.model_parts)
    trainer.checkpointer.hf.save(model.state_dict(), out_dir, dtype)
    with torch.no_grad():  # forget the weights, then read them back from the folder
        for part in trainer.model_parts:
            for p in part.parameters():
                p.zero_()
    state, nbytes = trainer.checkpointer.hf.load_into(model.state_dict(), out_dir)
    model.load_state_dict(state)
    back = full_state(trainer)
    trainer.close()
    return nbytes, back if rank == 0 else {}


LAYOUTS = {
    **layouts("tp2", "pp2", "fsdp2_tp2"),
    # 16 heads over 3 shards: shards cut through heads, so the q/k permutation gathers
    "fsdp3": (3, degrees(data_parallel_shard=3)),
}


@pytest.mark.parametrize(
    "layout,dtype,flavor",
    [
        ("tp2", "float32", "debugmodel"),
        ("pp2", "bfloat16", "debugmodel"),
        ("fsdp3", "float32", "debugmodel"),
        ("fsdp2_tp2", "bfloat16", "debugmodel"),
        # both stages hold the tied matrix: each writes and reads it as embed_tokens
        ("pp2", "float32", "debugmodel_tied"),
        ("tp2", "bfloat16", "debugmodel_tied"),
    ],
)
def test_round_trip_from_sharded_layouts(layout, dtype, flavor, tmp_path):
    world, flags = LAYOUTS[layout]
    args = LLAMA.flavors[flavor].with_updates(vocab_size=2048, max_seq_len=32)
    argv = [*BASE, *flags, "--model.flavor", flavor, "--job.dump_folder", str(tmp_path / "dump")]
    out = tmp_path / "hf"
    _, back = run_workers(
        round_trip, world, tmp_path, free_port(), argv, out, dtype, init_pg=False, deadline_s=120
    )[0]

    expected = {k: v.to(getattr(torch, dtype)) for k, v in seeded_state(args).items()}
    from_folder = hf_io.load_hf(out, LLAMA)  # one process, as HF tooling would read it
    for name, t in expected.items():
        assert from_folder[name].dtype == t.dtype and torch.equal(from_folder[name], t), name
        assert torch.equal(back[name], t.float()), name  # read back into the same layout
    assert not (out / ".sharded").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype


# ----------------------------------------------------------------------------- final save


@pytest.fixture(scope="module")
def final_saves(tmp_path_factory):
    """Two deterministic FSDP 2 runs: one ends in a DCP model-only save, one in an HF folder."""
    tmp = tmp_path_factory.mktemp("final")
    common = [
        *BASE,
        "--training.steps",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "10",
    ]
    run_trainer(tmp / "dcp", 2, [*common, "--checkpoint.last_save_model_only"])
    run_trainer(tmp / "hf", 2, [*common, "--checkpoint.last_save_in_hf"])
    return (
        tmp / "dcp" / "dump" / "checkpoint" / "step-2",
        tmp / "hf" / "dump" / "checkpoint" / "step-2",
    )


def test_last_save_in_hf_is_an_hf_folder_and_not_resumed(final_saves):
    dcp_step, hf_step = final_saves
    # the same trained weights (deterministic runs), one written as HF by both ranks
    trained = checkpoint.load_dcp_model_state(dcp_step)
    exported = hf_io.load_hf(hf_step, LLAMA)
    assert set(exported) == set(trained)
    for name, t in exported.items():
        assert torch.equal(t, trained[name]), name
    names = {p.name for p in hf_step.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors",
    } <= names
    cfg = json.loads((hf_step / "config.json").read_text())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)  # the bundled tokenizer's
    assert json.loads((hf_step / "generation_config.json").read_text())["eos_token_id"] == 1
    assert json.loads((hf_step / checkpoint.COMPLETE_MARKER).read_text())["format"] == "hf"
    assert checkpoint.folder_problem(hf_step) == checkpoint.HF_EXPORT


@pytest.mark.needs("transformers")
def test_transformers_reads_the_final_hf_save(final_saves):
    import warnings

    import transformers

    from titan.components.data.tokenizer import Tokenizer

    dcp_step, hf_step = final_saves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            str(hf_step), dtype=torch.float32, attn_implementation="eager"
        ).eval()
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_step))
    text = "In the beginning God created the heaven and the earth."
    ours = Tokenizer(str(hf_step / "tokenizer.json")).encode(text, eos=False)
    assert hf_tok(text).input_ids == ours  # BOS added as titan adds it
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1)
    assert hf_model.generation_config.eos_token_id == 1

    args = LLAMA.flavors["debugmodel"].with_updates(vocab_size=2048, max_seq_len=32)
    titan_model = LLAMA.build_meta(args)
    titan_model.to_empty(device="cpu")
    titan_model.init_weights(0)
    titan_model.load_state_dict(checkpoint.load_dcp_model_state(dcp_step))
    tokens = torch.tensor([ours[:32]])
    with torch.no_grad():
        torch.testing.assert_close(titan_model(tokens), hf_model(tokens).logits, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- offline conversion


def _convert(rank, world_size, port, hf_dir, out):
    import importlib.util
    from pathlib import Path

    from tests.forked import torchrun_env

    torchrun_env(rank, world_size, port)
    read = []
    load_into = hf_io.load_hf_into

    def counted(*args, **kw):
        state, nbytes = load_into(*args, **kw)
        read.append(nbytes)
        return state, nbytes

    hf_io.load_hf_into = counted
    script = Path(__file__).resolve().parents[2] / "scripts" / "convert_from_hf.py"
    spec = importlib.util.spec_from_file_location("convert_from_hf", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(hf_dir), str(out)])
    return {"read": read[0]}


def test_convert_from_hf_under_torchrun_reads_a_slice_per_rank(tmp_path):
    reference = seeded_state(WIDE, seed=5)
    hf_dir = hf_io.save_hf(reference, LLAMA, WIDE, tmp_path / "hf", max_shard_size="30MB")
    model_bytes = sum(t.numel() * 4 for t in reference.values())
    ranks = run_workers(
        _convert, 2, tmp_path, free_port(), hf_dir, tmp_path / "dcp", init_pg=False, deadline_s=120
    )
    assert [r["read"] for r in ranks] == [model_bytes // 2] * 2
    converted = checkpoint.load_dcp_model_state(tmp_path / "dcp")
    assert set(converted) == set(reference)
    for name, t in reference.items():
        assert torch.equal(converted[name], t), name
