"""Image-text data (training.dataset_format = "images"): records packed whole into windows
(an image never cut by a window edge), the loss on the caption only, the multimodal positions
transformers computes, each window's pixels as the processor's rule cuts its images; the same
records read from JSON lines, WebDataset tar shards and a parquet dataset with an Image
feature; bad input named by file and record."""

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from titan.components.data.batch import collate
from titan.components.data.dataset import DataError
from titan.components.training.loss import IGNORE_INDEX

pytestmark = pytest.mark.needs("PIL")

SHAPES = "assets/images/shapes"
RULE_ARGS = dict(patch_size=8, merge_size=2, min_pixels=4096, max_pixels=16384)


def tokenizer():
    from titan.components.data.tokenizer import Tokenizer

    return Tokenizer("assets/tokenizer_vlm")


def windows(source, seq_len=128):
    from titan.components.data.image_text import image_text_windows
    from titan.components.data.images import ImageRule

    return image_text_windows(source, ImageRule(**RULE_ARGS), tokenizer(), seq_len, "shapes")


def jsonl_source(path=f"{SHAPES}/valid.jsonl"):
    from titan.components.data.image_sources import open_image_source

    return open_image_source(path, None, "image", "text", "training.dataset_path")


def records(path=f"{SHAPES}/valid.jsonl"):
    return [json.loads(line) for line in open(path)]


def packed_records(w):
    """(a record's ids, the labels its loss counts) of every record of the windows `w`, in
    order (a window's padding, which holds no image, left out)."""
    from titan.components.data.image_text import VisionTokens

    start = VisionTokens.of(tokenizer()).start
    for i in range(len(w)):
        s = w[i]
        docs = s["doc_ids"]
        for d in docs.unique().tolist():
            place = (docs == d).nonzero().flatten()
            ids, labels = s["input_ids"][place], s["labels"][place]
            if (ids == start).any():
                yield ids, labels[labels != IGNORE_INDEX]


def test_records_are_packed_whole_with_the_loss_on_their_captions():
    from titan.components.data.image_text import VisionTokens

    vt = VisionTokens.of(tokenizer())
    w = windows(jsonl_source())
    assert len(w) > 1
    captions = [r["text"] for r in records()]
    seen = 0
    for ids, counted in packed_records(w):
        assert ids[0] == tokenizer().bos_id
        starts, ends = (ids == vt.start).sum(), (ids == vt.end).sum()
        assert starts == ends == 1  # each record's image whole within its window
        text = tokenizer().decode(counted.tolist(), skip_special=True)
        assert text == captions[seen]  # the loss: the caption (and its EOS)
        assert counted[-1] == tokenizer().eos_id
        seen += 1
    assert seen == len(captions)
    for i in range(len(w)):
        # one place per 2x2 patches of each image, every slot once, in order
        s = w[i]
        ids = s["input_ids"]
        pads = (ids == vt.pad).sum().item()
        assert s["image_grid_thw"].prod(-1).sum().item() == 4 * pads
        assert s["vision_slots"][ids == vt.pad].tolist() == list(range(pads))
        assert (s["vision_slots"][ids != vt.pad] == -1).all()


def test_a_windows_pixels_are_its_images_cut_by_the_rule():
    from PIL import Image

    from titan.components.data.images import ImageRule, image_patches

    w = windows(jsonl_source())
    s = w[0]
    first = [r["image"] for r in records()][: len(s["image_grid_thw"])]
    expected = [image_patches(Image.open(f"{SHAPES}/{p}"), ImageRule(**RULE_ARGS)) for p in first]
    assert torch.equal(s["pixel_values"], torch.cat([p for p, _ in expected]))
    assert s["image_grid_thw"].tolist() == [g.tolist() for _, g in expected]


@pytest.mark.needs("transformers")
def test_positions_are_transformers_multimodal_positions():
    """Each record's (time, row, column) positions, from 0, as Qwen3-VL's get_rope_index."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    from titan.components.data.image_text import VisionTokens
    from titan.models.spec import get_train_spec

    args = get_train_spec("qwen3_vl").flavors["debugmodel"]
    cfg = get_train_spec("qwen3_vl").state_dict_adapter(args).hf_config()
    hf = Qwen3VLModel(Qwen3VLConfig(**{k: v for k, v in cfg.items() if k != "torch_dtype"}))
    vt = VisionTokens.of(tokenizer())
    s = windows(jsonl_source())[1]
    docs, image = s["doc_ids"], 0
    for d in docs.unique().tolist()[:-1]:
        place = (docs == d).nonzero().flatten()
        ids = s["input_ids"][place]
        n = int((ids == vt.start).sum())
        grids = s["image_grid_thw"][image : image + n]
        image += n
        theirs, _ = hf.get_rope_index(ids[None], (ids == vt.pad).int()[None], image_grid_thw=grids)
        assert torch.equal(s["positions"][place].T, theirs[:, 0]), d


def test_collate_pads_the_rows_images():
    w = windows(jsonl_source())
    batch = collate([w[0], w[1]])
    patches = [w[i]["pixel_values"].shape[0] for i in (0, 1)]
    assert batch["pixel_values"].shape[:2] == (2, max(patches))
    short = patches.index(min(patches))
    assert (batch["pixel_values"][short, min(patches) :] == 0).all()
    images = [len(w[i]["image_grid_thw"]) for i in (0, 1)]
    assert batch["image_grid_thw"].shape[:2] == (2, max(images))
    assert batch["positions"].shape == (2, 128, 3)


def write_shard(shard, rows=None):
    """The validation pictures as one WebDataset-style shard: KEY.png and KEY.json."""
    shard.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(shard, "w") as tar:
        for i, r in enumerate(rows or records()):
            for name, data in (
                (f"{i:05d}.png", open(f"{SHAPES}/{r['image']}", "rb").read()),
                (f"{i:05d}.json", json.dumps({"text": r["text"]}).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return shard


@pytest.mark.needs("moto", "s3fs", "upath")
def test_tar_shards_in_object_storage_give_the_local_windows(tmp_path, monkeypatch):
    """s3://bucket/prefix of tar shards: copied once into the cache, read as local shards."""
    from tests.s3_server import s3_server
    from titan.components.data.image_sources import open_image_source

    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "cache"))
    shard = write_shard(tmp_path / "part-0000.tar")
    with s3_server("pictures") as client:
        client.upload_file(str(shard), "pictures", "shards/part-0000.tar")
        got = windows(open_image_source("s3://pictures/shards", None, "image", "text", "k"))
    expected = windows(jsonl_source())
    assert len(got) == len(expected)
    for i in range(len(got)):
        assert all(torch.equal(got[i][k], t) for k, t in expected[i].items())


def test_tar_shards_and_an_image_feature_dataset_give_the_same_windows(tmp_path):
    from datasets import Dataset, Image

    from titan.components.data.image_sources import open_image_source

    rows = records()
    shard = write_shard(tmp_path / "shards" / "part-0000.tar")
    table = Dataset.from_dict(
        {"picture": [f"{SHAPES}/{r['image']}" for r in rows], "text": [r["text"] for r in rows]}
    ).cast_column("picture", Image())
    table.to_parquet(str(tmp_path / "data.parquet"))
    expected = windows(jsonl_source())
    for source in (
        open_image_source(str(shard.parent), None, "image", "text", "k"),
        open_image_source(str(tmp_path / "data.parquet"), None, "picture", "text", "k"),
    ):
        got = windows(source)
        assert len(got) == len(expected)
        for i in range(len(got)):
            for name, t in expected[i].items():
                assert torch.equal(got[i][name], t), name


def test_bad_images_are_named_by_file_and_record(tmp_path):
    rows = records()[:3]
    for r in rows:
        shutil.copy(f"{SHAPES}/{r['image']}", tmp_path / r["image"].split("/")[-1])
    data = tmp_path / "data.jsonl"

    def write(rows_out):
        data.write_text("".join(json.dumps(r) + "\n" for r in rows_out))

    write([{**r, "image": r["image"].split("/")[-1]} for r in rows])
    missing = [
        *json.loads(f"[{data.read_text().splitlines()[0]}]"),
        {"image": "nope.png", "text": "x"},
    ]
    write(missing)
    with pytest.raises(DataError, match=r"data.jsonl: record 2: image .*nope.png does not exist"):
        windows(jsonl_source(str(data)))
    # a truncated picture: indexed by its header, refused whole when a worker decodes it
    name = rows[0]["image"].split("/")[-1]
    raw = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(raw[: len(raw) // 2])
    write([{"image": name, "text": "half a picture"}])
    w = windows(jsonl_source(str(data)))
    with pytest.raises(
        DataError, match=r"data.jsonl: record 1: the image is unreadable or truncated"
    ):
        w[0]
    write([{"text": "no picture"}])
    with pytest.raises(DataError, match=r"record 1 has no image path in field 'image'"):
        windows(jsonl_source(str(data)))


def test_records_longer_than_a_window_are_left_out_or_refused(caplog):
    w = windows(jsonl_source(), seq_len=40)  # a 96-pixel side takes 24 image places
    assert any("longer than training.seq_len 40 left out" in r.message for r in caplog.records)
    assert 0 < len(w)
    with pytest.raises(DataError, match="no record fits training.seq_len 16"):
        windows(jsonl_source(), seq_len=16)


def test_a_tokenizer_without_vision_tokens_is_refused():
    from titan.components.data.image_text import VisionTokens
    from titan.components.data.tokenizer import Tokenizer

    with pytest.raises(
        DataError, match=r"has no <\|vision_start\|>, <\|vision_end\|>, <\|image_pad\|>"
    ):
        VisionTokens.of(Tokenizer("assets/tokenizer"))


def test_a_text_flavor_or_another_tokenizer_given_image_data_is_refused():
    from tests.forked import tiny_run
    from titan.config import ConfigError, parse_args
    from titan.plan.run_plan import plan_run

    images = ["--training.dataset", "shapes", "--training.dataset_format", "images"]
    block = ["--model.attn_mask_type", "block_causal"]
    text_flavor = ["--model.name", "qwen3_5", "--model.flavor", "debugmodel"]
    with pytest.raises(ConfigError, match="debugmodel' has no vision tower"):
        plan_run(
            parse_args(
                [
                    *tiny_run(1),
                    *images,
                    *block,
                    *text_flavor,
                    "--model.tokenizer_path",
                    "assets/tokenizer_vlm",
                ]
            ),
            world_size=1,
        )
    vl = ["--model.name", "qwen3_vl", "--model.flavor", "debugmodel"]
    with pytest.raises(ConfigError, match="tokenizer has no <"):
        plan_run(
            parse_args(
                [*tiny_run(1), *images, *block, *vl, "--model.tokenizer_path", "assets/tokenizer"]
            ),
            world_size=1,
        )
    with pytest.raises(ConfigError, match="model.attn_mask_type = 'causal'.*block_causal"):
        parse_args([*tiny_run(1), *images, *vl])


def test_image_chat_trains_on_the_answers_only():
    """shapes_chat: a user turn holding the picture and a question, the caption as the
    answer, rendered with the tokenizer folder's template (assets/tokenizer_vlm: ChatML with
    the vision tokens); the loss counts the answer and its <|im_end|>, not the prompt or the
    image."""
    rows = [json.loads(line) for line in open(f"{SHAPES}/chat_valid.jsonl")]
    w = windows(jsonl_source(f"{SHAPES}/chat_valid.jsonl"))
    got = list(packed_records(w))
    assert len(got) == len(rows)
    for (ids, counted), row in zip(got, rows, strict=True):
        text = tokenizer().decode(ids.tolist(), skip_special=False)
        assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
        answer = tokenizer().decode(counted.tolist(), skip_special=True)
        assert answer.strip() == row["messages"][1]["content"]
        assert counted[-1] == tokenizer().token_id("<|im_end|>")


def test_image_chat_placeholders_must_match_the_images(tmp_path):
    row = json.loads(open(f"{SHAPES}/chat_valid.jsonl").readline())
    shutil.copy(f"{SHAPES}/{row['image']}", tmp_path / "p.png")
    row["image"] = ["p.png", "p.png"]  # two images, one placeholder
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl: record 1 has 1 image placeholder\(s\).* for 2"):
        windows(jsonl_source(str(tmp_path / "d.jsonl")))


def test_the_launchers_look_at_image_records_names_the_field(tmp_path):
    """Before any rank starts: the first lines name an image and hold a caption or a
    conversation (the launcher's content check)."""
    from titan.components.data.content_check import check_image_file

    check_image_file(Path(f"{SHAPES}/chat_valid.jsonl"), "image", "text", "messages")
    check_image_file(Path(f"{SHAPES}/valid.jsonl"), "image", "text", "messages")
    bad = tmp_path / "d.jsonl"
    bad.write_text(json.dumps({"picture": "a.png", "text": "x"}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl line 1 has no 'image' field.*images.image_field"):
        check_image_file(bad, "image", "text", "messages")
    bad.write_text(json.dumps({"image": "a.png", "caption": "x"}) + "\n")
    with pytest.raises(DataError, match=r"neither a caption in 'text' nor a conversation"):
        check_image_file(bad, "image", "text", "messages")
