"""Issue 49 §1: datasets as they are shared, read by discover: Hugging Face datasets (save_to_disk, parquet shards,
a hub id through the Hugging Face cache), WebDataset shards, CSV/TSV/parquet manifests of paths or URLs, remote
over a real HTTP server on 127.0.0.1; each bad input a verdict that names its shard and key, or its file and row;
a source that cannot be read at all one line."""

import io

import pytest
from PIL import Image

from tests.data_sources import (
    FileServer,
    hub_cache,
    tiny_rows,
    write_csv,
    write_files,
    write_parquet,
    write_parquet_manifest,
    write_save_to_disk,
    write_shards,
    write_tar,
)
from zerotrain.config import DataConfig
from zerotrain.data.dataset import discover
from zerotrain.data.images import ImageRejected, load_rgb
from zerotrain.data.sources import Packed, expand_braces
from zerotrain.errors import ZerotrainError

ROWS = tiny_rows()
CAPTIONS = [caption for *_, caption in ROWS]


def data(*datasets, **fields) -> DataConfig:
    return DataConfig(datasets=[d if isinstance(d, dict) else {"path": str(d)} for d in datasets], min_image_size=16,
                      **fields)


def seen(found) -> list[tuple[str, int, int]]:
    return [(item.caption, item.width, item.height) for item in found.items]


EXPECTED = [(caption, *Image.open(io.BytesIO(png)).size) for _, png, caption in ROWS]


def test_brace_patterns_expand_as_webdataset_writes_them():
    assert expand_braces("s-{0000..0002}.tar") == ["s-0000.tar", "s-0001.tar", "s-0002.tar"]
    assert expand_braces("{a,b}/x-{8..10}.tar") == ["a/x-8.tar", "a/x-9.tar", "a/x-10.tar", "b/x-8.tar",
                                                     "b/x-9.tar", "b/x-10.tar"]


def test_save_to_disk_folder(tmp_path):
    found = discover(data(write_save_to_disk(tmp_path / "hf", ROWS)))
    assert seen(found) == EXPECTED and not found.verdicts
    assert all(isinstance(item.image, Packed) and item.image.key.startswith("row ") for item in found.items)


def test_parquet_shards_of_one_split(tmp_path):
    folder = write_parquet(tmp_path / "pq", ROWS[:5])
    write_parquet(folder, ROWS[5:], shards=1, split="test")
    assert seen(discover(data(folder))) == EXPECTED[:5]
    assert seen(discover(data({"path": str(folder), "split": "test"}))) == EXPECTED[5:]


def test_hub_dataset_id_through_the_hugging_face_cache(tmp_path, monkeypatch):
    hub_cache(tmp_path / "hub", "org/tiny-shapes", write_parquet(tmp_path / "pq", ROWS))
    from huggingface_hub import constants

    # What HF_HUB_CACHE and HF_HUB_OFFLINE=1 give, read by huggingface_hub when it is imported.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert seen(discover(data("hf://datasets/org/tiny-shapes"))) == EXPECTED
    with pytest.raises(ZerotrainError, match=r"data.datasets\[0\].path: the hub dataset org/absent cannot be fetched"):
        discover(data("hf://datasets/org/absent"))


@pytest.mark.parametrize("caption", ["txt", "json"])
def test_webdataset_shards_by_brace_pattern(tmp_path, caption):
    pattern = write_shards(tmp_path, ROWS, per_shard=3, caption=caption)
    assert pattern == "shards-{0000..0002}.tar"
    found = discover(data(tmp_path / pattern))
    assert seen(found) == EXPECTED and not found.verdicts
    assert str(found.items[3].image) == f"{tmp_path}/shards-0001.tar:{ROWS[3][0]}.png"


def test_webdataset_shards_by_list(tmp_path):
    write_shards(tmp_path, ROWS, per_shard=3)
    shards = [str(tmp_path / f"shards-{k:04d}.tar") for k in (2, 0)]  # in the order given
    found = discover(data({"path": shards}))
    assert seen(found) == EXPECTED[6:] + EXPECTED[:3] and not found.verdicts
    with pytest.raises(ValueError, match=r"absent.tar does not exist"):
        data({"path": [shards[0], str(tmp_path / "absent.tar")]})


def test_webdataset_masks_are_read_from_key_mask_png(tmp_path):
    mask = io.BytesIO()
    Image.new("L", Image.open(io.BytesIO(ROWS[0][1])).size, 128).save(mask, "PNG")
    write_tar(tmp_path / "s.tar", [("a.png", ROWS[0][1]), ("a.txt", b"masked"), ("a.mask.png", mask.getvalue())])
    found = discover(data(tmp_path / "s.tar", mask="file"))
    assert found.items[0].mask is not None and found.items[0].mask.key == "a.mask.png" and not found.verdicts


@pytest.mark.parametrize("form", ["csv", "tsv", "parquet"])
def test_manifests_of_paths_relative_to_the_manifest(tmp_path, form):
    images = [f"files/{p.name}" for p in write_files(tmp_path / "files", ROWS)]
    if form == "parquet":
        manifest = write_parquet_manifest(tmp_path / "list.parquet", images, CAPTIONS)
    else:
        manifest = write_csv(tmp_path / f"list.{form}", images, CAPTIONS, "\t" if form == "tsv" else ",")
    found = discover(data(manifest))
    assert seen(found) == EXPECTED and found.items[0].image == tmp_path / images[0]


def test_named_columns_and_a_wrong_column_is_one_line(tmp_path):
    images = [str(p) for p in write_files(tmp_path / "files", ROWS)]
    manifest = write_csv(tmp_path / "m.csv", images, CAPTIONS, header=("picture", "alt"))
    found = discover(data({"path": str(manifest), "image_column": "picture", "caption_column": "alt"}))
    assert seen(found) == EXPECTED
    with pytest.raises(ZerotrainError, match=r"^data.datasets\[0\]: .*m.csv has none of the image columns image, "
                                             r".* \(its columns: picture, alt\); name it with "
                                             r"data.datasets\[0\].image_column$"):
        discover(data(manifest))
    with pytest.raises(ZerotrainError, match=r"data.datasets\[0\].caption_column: .*m.csv has no column 'text'"):
        discover(data({"path": str(manifest), "image_column": "picture", "caption_column": "text"}))


def test_a_pattern_that_matches_nothing_is_one_line(tmp_path):
    with pytest.raises(ZerotrainError, match=r"data.datasets\[0\].path: .*shards-\{0000..0003\}.tar names no .tar "
                                             "file"):
        discover(data(str(tmp_path / "shards-{0000..0003}.tar")))


def test_a_missing_cloud_backend_names_its_extra():
    with pytest.raises(ZerotrainError, match=r"gs://bucket/s-0000.tar: reading gs:// needs gcsfs, which is not "
                                             r"installed: pip install 'zerotrain\[gcs\]'$"):
        discover(data("gs://bucket/s-{0000..0001}.tar"))


def test_bad_tar_members_get_verdicts_naming_shard_and_key(tmp_path):
    good, other = ROWS[0][1], ROWS[1][1]
    write_tar(tmp_path / "s-0000.tar", [("ok.png", good), ("ok.txt", b"fine"),
                                         ("junk.png", b"these bytes are not an image"), ("junk.txt", b"junk"),
                                         ("latin.png", other), ("latin.txt", "caf\xe9".encode("latin-1")),
                                         ("cut.png", good[:len(good) // 2]), ("cut.txt", b"cut")])
    found = discover(data(tmp_path / "s-0000.tar", max_rejected_fraction=1.0))
    reasons = {str(v.path).rsplit("/", 1)[-1]: v.reason for v in found.verdicts}
    assert reasons == {"s-0000.tar:junk.png": "not an image", "s-0000.tar:latin.png": "caption not UTF-8 (latin.txt)"}
    # A cut image's header reads; the cache build's decode rejects it, as a cut file of a folder.
    assert [item.caption for item in found.items] == ["fine", "cut"]
    load_rgb(found.items[0].image)
    with pytest.raises(ImageRejected, match=r"s-0000.tar:cut.png: the file is truncated") as cut:
        load_rgb(found.items[1].image)
    assert cut.value.reason == "truncated"


def test_a_truncated_shard_keeps_the_samples_before_the_cut(tmp_path):
    shard = write_tar(tmp_path / "s.tar", [(f"{stem}.png", png) for stem, png, _ in ROWS[:4]])
    whole = shard.read_bytes()
    # Each member is a 512-byte header and one 512-byte block of data: the 4th is cut in its header.
    shard.write_bytes(whole[:3 * 1024 + 100])
    found = discover(data(shard, max_rejected_fraction=1.0, missing_caption="filename"))
    assert [item.caption for item in found.items] == [stem for stem, *_ in ROWS[:3]]
    assert [(str(v.path), v.reason) for v in found.rejected] == [
        (str(shard), ("shard unreadable after 3 samples (ReadError: unexpected end of data in a member's header); "
                      "those are used"))]
    # Cut in its data: its header was read, its bytes are short.
    shard.write_bytes(whole[:3 * 1024 + 600])
    found = discover(data(shard, max_rejected_fraction=1.0, missing_caption="filename"))
    assert [item.caption for item in found.items] == [stem for stem, *_ in ROWS[:3]]
    assert [(str(v.path), v.reason) for v in found.rejected] == [
        (str(shard), "shard unreadable after 4 samples (ReadError: unexpected end of data); those are used"),
        (f"{shard}:{ROWS[3][0]}.png", "truncated")]


def test_a_corrupt_parquet_row_is_a_verdict_naming_file_and_row(tmp_path):
    rows = [*ROWS[:3], ("bad", b"\x89PNG\r\n\x1a\n broken", "bad row")]
    folder = write_parquet(tmp_path / "pq", rows, shards=1)
    found = discover(data(folder, max_rejected_fraction=0.5))
    assert [str(v.path).rsplit("/", 1)[-1] for v in found.rejected] == ["train-00000-of-00001.parquet:row 3"]
    assert found.rejected[0].reason in ("corrupt", "truncated") and len(found.items) == 3


def test_csv_verdicts_missing_image_and_caption_not_utf8(tmp_path):
    images = [str(p) for p in write_files(tmp_path / "files", ROWS[:3])]
    manifest = tmp_path / "m.csv"
    manifest.write_bytes(b"image,caption\n" + f"{images[0]},one\n{images[1]},".encode() + "caf\xe9".encode("latin-1")
                         + f"\n{tmp_path}/files/absent.png,gone\n{images[2]},three\n".encode())
    found = discover(data(manifest, max_rejected_fraction=1.0))
    assert [item.caption for item in found.items] == ["one", "three"]
    reasons = {str(v.path): v.reason for v in found.rejected}
    assert reasons == {images[1]: f"caption not UTF-8 ({manifest} line 3)", f"{tmp_path}/files/absent.png": "missing file"}


def test_remote_shards_and_urls_over_http(tmp_path):
    """Shards read by range requests (only the members' bytes); a manifest of URLs; a 404 and a timeout are
    verdicts naming the URL."""
    pattern = write_shards(tmp_path / "wds", ROWS)
    write_files(tmp_path / "files", ROWS[:3])
    with FileServer(tmp_path, delay=3.0) as server:
        urls = [f"{server.url}/files/{stem}.png" for stem, *_ in ROWS[:3]]
        slow = f"{server.url}/slow/files/{ROWS[0][0]}.png"
        write_csv(tmp_path / "urls.csv", [*urls, f"{server.url}/files/absent.png", slow], [*CAPTIONS[:3], "gone", "slow"])
        found = discover(data(f"{server.url}/wds/{pattern}"))
        assert seen(found) == EXPECTED and not found.verdicts
        assert str(found.items[0].image) == f"{server.url}/wds/shards-0000.tar:{ROWS[0][0]}.png"
        assert any(r for _, path, r in server.requests if path.endswith(".tar") and r)  # members by range
        found = discover(data({"path": f"{server.url}/urls.csv", "timeout_seconds": 1.0}, max_rejected_fraction=1.0))
        assert seen(found) == EXPECTED[:3]
        assert {str(v.path): v.reason for v in found.rejected} == {
            f"{server.url}/files/absent.png": "missing file",
            f"{server.url}/slow/files/{ROWS[0][0]}.png": "unreachable"}
