"""Caption handling (issue 25): a prefix per dataset, several captions per image, tag shuffling
from a bounded set of orders, and caption dropout drawn per sample from the seed and the epoch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from zerotrain.config import DataConfig
from zerotrain.data.dataset import discover, shuffled_tags
from zerotrain.data.sampler import BucketBatchSampler

TAGS = "ohwx, red car, street, night, rain, neon"


def image(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64), (10, 20, 30)).save(path)
    return path


def data(tmp_path, **dataset) -> DataConfig:
    return DataConfig(datasets=[{"path": str(tmp_path), **dataset}], min_image_size=16)


def test_a_prefix_goes_before_every_caption_of_its_dataset(tmp_path):
    image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a red car")
    [item] = discover(data(tmp_path, caption_prefix="ohwx person, ")).items
    assert item.texts == ("ohwx person, a red car",) and item.caption == "ohwx person, a red car"


def test_several_captions_per_image_from_lines_or_a_manifest_list(tmp_path):
    image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("first caption\n\n second caption \n")
    [whole] = discover(data(tmp_path)).items
    assert whole.texts == ("first caption\n\n second caption",)
    [lines] = discover(data(tmp_path, caption_per_line=True)).items
    assert lines.texts == ("first caption", "second caption")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"image": "a.png", "caption": ["one", "two", "one"]}) + "\n"
                        + json.dumps({"image": "a.png", "caption": []}) + "\n")
    found = discover(DataConfig(datasets=[{"path": str(manifest)}], min_image_size=16))
    assert [item.texts for item in found.items] == [("one", "two")]
    assert any("manifest line 2" in v.reason for v in found.rejected)


def test_tags_shuffle_into_a_bounded_set_of_orders_keeping_the_first(tmp_path):
    orders = shuffled_tags(TAGS, 4, keep=1)
    assert orders == shuffled_tags(TAGS, 4, keep=1)  # the same orders every time: the cache stays valid
    assert 2 <= len(orders) <= 4 and len(set(orders)) == len(orders)
    for order in orders:
        tags = order.split(", ")
        assert tags[0] == "ohwx" and sorted(tags) == sorted(TAGS.split(", "))
    assert shuffled_tags(TAGS, 0, keep=1) == [TAGS]
    assert shuffled_tags("one tag", 4, keep=0) == ["one tag"]
    image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text(TAGS)
    [item] = discover(data(tmp_path, shuffle_tags=4, keep_tags=1, caption_prefix="photo, ")).items
    assert item.texts == tuple("photo, " + order for order in orders)


def test_caption_dropout_per_dataset_or_from_data(tmp_path):
    image(tmp_path / "a" / "x.png")
    image(tmp_path / "b" / "y.png")
    config = DataConfig(datasets=[{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b"), "caption_dropout": 0.5}],
                        min_image_size=16, caption_dropout=0.1)
    assert [item.caption_dropout for item in discover(config).items] == [0.1, 0.5]


def sampler(texts, world=1, rank=0, seed=3, samples=400):
    return BucketBatchSampler([0] * samples, 8, 1, world, rank, seed, texts)


def pairs(s: BucketBatchSampler) -> dict[int, int]:
    return dict(pair for batch in s for pair in batch)


def test_the_dropout_share_over_an_epoch_is_the_asked_share_and_the_same_on_any_world_size():
    n, dropout = 400, 0.25
    one = sampler([(3, dropout)] * n)
    drawn = pairs(one)
    assert sorted(drawn) == list(range(n))
    dropped = sum(choice == -1 for choice in drawn.values())
    # binomial(400, 0.25): mean 100, standard deviation 8.7; a fixed seed, so this is one number
    assert 70 <= dropped <= 130, dropped
    kept = [choice for choice in drawn.values() if choice >= 0]
    assert set(kept) == {0, 1, 2} and min(np.bincount(kept)) > 60
    two = {**pairs(sampler([(3, dropout)] * n, world=2, rank=0)), **pairs(sampler([(3, dropout)] * n, world=2, rank=1))}
    assert two == drawn
    one.set_epoch(1)
    assert pairs(one) != drawn  # another epoch, other draws


def test_no_choices_keep_plain_indices_and_zero_dropout_never_drops():
    assert all(isinstance(i, int) for batch in sampler([(1, 0.0)] * 400) for i in batch)
    assert all(isinstance(i, int) for batch in sampler(None) for i in batch)
    assert -1 not in pairs(sampler([(2, 0.0)] * 400)).values()


@pytest.mark.parametrize("stop", [1, 17])
def test_a_resume_draws_the_same_texts(stop):
    texts = [(2, 0.3)] * 400
    straight = [batch for batch in sampler(texts)]
    first = sampler(texts)
    first.advance(stop)
    resumed = sampler(texts)
    resumed.load_state_dict(first.state_dict())
    assert list(resumed) == straight[stop * 8:]  # 8 micro-batches per optimizer step


def test_a_share_sets_a_datasets_part_of_each_epoch_whatever_its_size(tmp_path):
    """DreamBooth's prior preservation: 3 subject images repeated 10 times, and a regularisation set
    of 50 images at half of each epoch, each with its loss weight."""
    for n in range(3):
        image(tmp_path / "subject" / f"{n}.png")
    for n in range(50):
        image(tmp_path / "reg" / f"{n}.png")
    config = DataConfig(datasets=[{"path": str(tmp_path / "subject"), "repeats": 10},
                                  {"path": str(tmp_path / "reg"), "share": 0.5, "loss_weight": 0.8}],
                        min_image_size=16)
    found = discover(config)
    samples = found.samples(seed=1)
    from_reg = [i for i in samples if found.items[i].dataset == 1]
    assert len(samples) == 60 and len(from_reg) == 30  # 30 subject samples are the other half
    assert len(set(from_reg)) == 30 and set(from_reg) != {
        i for i in found.samples(seed=2) if found.items[i].dataset == 1}  # another seed, another subset
    assert {found.items[i].loss_weight for i in from_reg} == {0.8}
    # a share above the images' count repeats them
    small = DataConfig(datasets=[{"path": str(tmp_path / "subject"), "share": 0.75},
                                 {"path": str(tmp_path / "reg"), "share": 0.25}], min_image_size=16)
    found = discover(small)
    samples = found.samples()
    assert len(samples) == 53 and sum(found.items[i].dataset == 0 for i in samples) == 40  # round(0.75 x 53)
    with pytest.raises(ValueError, match="add up to 0.9, not 1"):
        DataConfig(datasets=[{"path": str(tmp_path / "subject"), "share": 0.5},
                             {"path": str(tmp_path / "reg"), "share": 0.4}])
    with pytest.raises(ValueError, match="leaving nothing"):
        DataConfig(datasets=[{"path": str(tmp_path / "subject"), "share": 1.0}, {"path": str(tmp_path / "reg")}])


def test_a_datasets_loss_weight_weights_its_samples_loss():
    import torch

    from zerotrain.objectives import dataset_weights, mse_loss

    pred, target = torch.zeros(2, 4), torch.ones(2, 4)
    batch = {"loss_weight": torch.tensor([1.0, 0.25])}
    assert mse_loss(pred, target, dataset_weights(batch, None)).item() == pytest.approx((1.0 + 0.25) / 2)
    assert dataset_weights({}, None) is None
    snr = torch.tensor([2.0, 2.0])
    assert dataset_weights(batch, snr).tolist() == [2.0, 0.5]
