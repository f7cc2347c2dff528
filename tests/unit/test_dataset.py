"""Finding images and captions: folders and manifests, repeats, caption policies, and a
verdict with a reason for each problem file."""

import json

import pytest
from PIL import Image

from zerotrain.config import DataConfig
from zerotrain.data.dataset import discover, enforce
from zerotrain.errors import ZerotrainError


def image(path, size=(96, 64), color=(200, 10, 10)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def config(*datasets, **fields):
    return DataConfig(datasets=[{"path": str(d[0]), "repeats": d[1]} if isinstance(d, tuple) else {"path": str(d)}
                                for d in datasets], min_image_size=16, **fields)


def test_folder_recursive_with_sidecar_captions(tmp_path):
    image(tmp_path / "a.jpg")
    (tmp_path / "a.txt").write_text("  a red box \n")
    image(tmp_path / "sub" / "deeper" / "b.PNG", size=(64, 128))
    (tmp_path / "sub" / "deeper" / "b.txt").write_text("tall")
    image(tmp_path / ".hidden.png")
    found = discover(config(tmp_path))
    assert [(i.image.name, i.caption, i.width, i.height) for i in found.items] == [
        ("a.jpg", "a red box", 96, 64), ("b.PNG", "tall", 64, 128)]
    assert not found.rejected


@pytest.mark.parametrize("policy,caption,kept", [("empty", "", True), ("filename", "my photo", True), ("skip", None, False)])
def test_missing_caption_policy_is_applied_and_reported(tmp_path, policy, caption, kept):
    image(tmp_path / "my_photo.png")
    found = discover(config(tmp_path, missing_caption=policy))
    assert (len(found.items) == 1) == kept
    if kept:
        assert found.items[0].caption == caption
    assert any("no caption" in v.reason for v in found.verdicts)
    assert any("no caption" in line for line in found.summary())


def test_bad_files_get_verdicts(tmp_path):
    image(tmp_path / "good.png")
    (tmp_path / "good.txt").write_text("ok")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "notes.jpg").write_text("this is not an image")
    image(tmp_path / "tiny.png", size=(8, 8))
    image(tmp_path / "latin1.png")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "orphan.txt").write_text("no image here")
    found = discover(config(tmp_path))
    reasons = {v.path.name: v.reason for v in found.verdicts}
    assert [i.image.name for i in found.items] == ["good.png"]
    assert reasons["empty.jpg"] == "empty file"
    assert reasons["notes.jpg"] == "not an image"
    assert reasons["tiny.png"] == "too small"
    assert reasons["latin1.png"].startswith("caption not UTF-8")
    assert reasons["orphan.txt"] == "caption without image"
    assert not next(v for v in found.verdicts if v.path.name == "orphan.txt").rejected


def test_manifest_with_relative_paths_and_bad_lines(tmp_path):
    image(tmp_path / "imgs" / "x.png")
    manifest = tmp_path / "data.jsonl"
    manifest.write_text("\n".join([
        json.dumps({"image": "imgs/x.png", "caption": "from the manifest"}),
        "{not json",
        json.dumps({"image": "imgs/missing.png", "caption": "gone"}),
        json.dumps({"caption": "no image key"}),
    ]))
    found = discover(config(manifest))
    assert [(i.image.name, i.caption) for i in found.items] == [("x.png", "from the manifest")]
    reasons = [v.reason for v in found.rejected]
    assert "missing file" in reasons
    assert sum(r.startswith("manifest line") for r in reasons) == 2


def test_several_datasets_with_repeats(tmp_path):
    for n in range(3):
        image(tmp_path / "subject" / f"{n}.png")
    for n in range(5):
        image(tmp_path / "reg" / f"{n}.png")
    found = discover(config((tmp_path / "subject", 10), (tmp_path / "reg", 1)))
    assert len(found.items) == 8
    samples = found.samples()
    assert len(samples) == 3 * 10 + 5
    assert sum(found.items[i].dataset == 0 for i in samples) == 30


def test_strict_stops_at_the_first_bad_file(tmp_path):
    image(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"")
    data = config(tmp_path, bad_files="strict")
    with pytest.raises(ZerotrainError, match=r"bad\.png: empty file .*data\.bad_files=strict"):
        enforce(discover(data), data)


def test_skip_aborts_past_the_rejected_fraction(tmp_path):
    image(tmp_path / "good.png")
    for n in range(3):
        (tmp_path / f"bad{n}.png").write_bytes(b"")
    data = config(tmp_path, max_rejected_fraction=0.5)
    with pytest.raises(ZerotrainError, match=r"3 of 4 images rejected \(empty file x3\)"):
        enforce(discover(data), data)
    lenient = config(tmp_path, max_rejected_fraction=0.9)
    enforce(discover(lenient), lenient)  # within the allowance: skipped and reported


def test_no_datasets_or_bad_path_is_one_line(tmp_path):
    with pytest.raises(ZerotrainError, match="data.datasets is empty"):
        discover(DataConfig())
    not_a_manifest = tmp_path / "list.txt"
    not_a_manifest.write_text("a.png\n")
    with pytest.raises(ZerotrainError, match=r"data\.datasets\[0\]\.path: .*list.txt is none of the forms zerotrain "
                                             r"reads: a folder of images, a \.jsonl manifest, a table"):
        discover(config(not_a_manifest))


def test_kohya_repeat_folders_count_their_images_n_times_and_say_so(tmp_path):
    """Issue 49: kohya's train_data_dir of <N>_<name> folders: N repeats each (times the dataset's repeats), a 0_
    folder left out with a note, other folders once; the summary lists them; folder_repeats: false reads them as
    plain folders."""
    for folder, count in (("10_ohwx person", 2), ("1_person", 3), ("0_unused", 1), ("plain", 1)):
        for n in range(count):
            image(tmp_path / folder / f"{n}.png")
    image(tmp_path / "top.png")
    image(tmp_path / "3_nested" / "deeper" / "x.png")  # the first-level folder counts, however deep the image

    def repeats(found):
        return sorted((str(i.image.relative_to(tmp_path).parent), i.repeats) for i in found.items)

    found = discover(config(tmp_path))
    assert repeats(found) == [(".", 1), ("10_ohwx person", 10), ("10_ohwx person", 10), ("1_person", 1),
                              ("1_person", 1), ("1_person", 1), ("3_nested/deeper", 3), ("plain", 1)]
    assert len(found.samples()) == 1 + 20 + 3 + 3 + 1
    assert [(v.path.parent.name, v.rejected) for v in found.verdicts if "kohya folder" in v.reason] == [("0_unused", False)]
    assert ("data.datasets[0]: kohya repeat folders, each image counted N times: 0_unused x0, 10_ohwx person x10, "
            "1_person x1, 3_nested x3 (data.datasets[0].folder_repeats: false reads them as plain folders)"
            ) in found.summary()
    tripled = discover(DataConfig(datasets=[{"path": str(tmp_path), "repeats": 3}], min_image_size=16))
    assert len(tripled.samples()) == 3 * len(found.samples())
    plain = discover(DataConfig(datasets=[{"path": str(tmp_path), "folder_repeats": False}], min_image_size=16))
    assert {i.repeats for i in plain.items} == {1} and len(plain.items) == 9 and not plain.repeat_folders
    assert not any("kohya repeat folders" in line for line in plain.summary())
