"""zerotrain/ema.py without DeepSpeed: the EMA rule, fragment coverage and reassembly, the
ema-<rank>.pt files and their checks, and ShardedEMA on a stand-in of DeepSpeed's ZeRO-0 bf16
optimizer (flat fp32 masters of bf16 parameters). tests/distributed/test_ema.py runs it on real
engines."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zerotrain.ema import (
    ShardedEMA,
    Span,
    check_coverage,
    ema_state_dict,
    ema_step,
    fill_span,
    overlap,
    reassemble,
)
from zerotrain.errors import ZerotrainError


def test_coverage_accepts_an_exact_tiling_in_any_order():
    check_coverage("w", [(5, 9), (0, 5), (9, 12)], 0, 12)
    check_coverage("w", [(3, 7)], 3, 7)


@pytest.mark.parametrize(("intervals", "words"), [
    ([(0, 5), (6, 12)], "elements 5..5 are in no"),
    ([(0, 5), (4, 12)], "elements 4..4 are in more than one"),
    ([(0, 5), (5, 11)], "elements 11..11 are in no"),
    ([], "elements 0..11 are in no"),
    ([(0, 12), (0, 12)], "more than one"),
])
def test_coverage_names_gaps_and_overlaps(intervals, words):
    with pytest.raises(ZerotrainError, match=words):
        check_coverage("w", intervals, 0, 12)


def test_overlap():
    span = Span("w", (12,), 3, 7)  # elements 3..9
    assert overlap(span, 0, 5) == (3, 5)
    assert overlap(span, 5, 100) == (5, 10)
    assert overlap(span, 4, 2) == (4, 6)
    assert overlap(span, 10, 2) is None and overlap(span, 0, 3) is None


def fragments_of(full: torch.Tensor, bounds: list[int]) -> list[dict]:
    """The fragments a partitioning with these boundaries would save."""
    flat = full.reshape(-1)
    return [{"offset": lo, "numel": hi - lo, "shape": list(full.shape), "tensor": flat[lo:hi].clone()}
            for lo, hi in itertools.pairwise(bounds)]


def test_fill_span_takes_its_range_out_of_another_partitioning():
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    saved = fragments_of(full, [0, 5, 13, 24])
    for offset, numel in [(0, 24), (3, 7), (12, 12), (13, 1)]:
        out = torch.full((numel,), -1.0)
        fill_span(out, Span("w", (4, 6), offset, numel), saved)
        assert torch.equal(out, full.reshape(-1)[offset:offset + numel])


def test_fill_span_refuses_a_gap_and_another_shape():
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    saved = fragments_of(full, [0, 5, 13, 24])
    with pytest.raises(ZerotrainError, match="elements 5..12 are in no"):
        fill_span(torch.empty(10), Span("w", (4, 6), 3, 10), [saved[0], saved[2]])
    with pytest.raises(ZerotrainError, match=r"shape \(4, 6\), the parameter has \(6, 4\)"):
        fill_span(torch.empty(24), Span("w", (6, 4), 0, 24), saved)


def test_ema_step_copies_until_the_start_step_then_averages():
    decay, start = 0.9, 2
    ema, expected = torch.zeros(5), torch.zeros(5)
    weights = [torch.randn(5, generator=torch.Generator().manual_seed(step)) for step in range(1, 7)]
    for step, master in enumerate(weights, start=1):
        ema_step(ema, master, step, start, decay)
        expected = master.clone() if step <= start else decay * expected + (1 - decay) * master
        torch.testing.assert_close(ema, expected, rtol=1e-6, atol=1e-7)
        if step <= start:
            assert torch.equal(ema, master)


def payload(rank: int, world: int, fragments: dict, step: int = 7) -> dict:
    return {"format": 1, "decay": 0.99, "start_step": 0, "step": step, "rank": rank, "world_size": world,
            "fragments": fragments}


def two_rank_payloads(a: torch.Tensor, b: torch.Tensor) -> list[dict]:
    """a split 13 | 11 between two ranks, b whole on rank 1 (as ZeRO-1/2 partitions a flat group)."""
    fa = fragments_of(a, [0, 13, 24])
    fb = fragments_of(b, [0, b.numel()])
    return [payload(0, 2, {"a": fa[0]}), payload(1, 2, {"a": fa[1], "b": fb[0]})]


def test_reassemble_rebuilds_full_tensors():
    a, b = torch.randn(4, 6), torch.randn(3)
    full = reassemble(two_rank_payloads(a, b))
    assert full.keys() == {"a", "b"}
    assert torch.equal(full["a"], a) and torch.equal(full["b"], b) and full["a"].dtype == torch.float32


def write(folder: Path, payloads: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for p in payloads:
        torch.save(p, folder / f"ema-{p['rank']}.pt")
    return folder


def test_ema_state_dict_reads_the_files_of_every_rank(tmp_path):
    a, b = torch.randn(4, 6), torch.randn(3)
    full = ema_state_dict(write(tmp_path / "ckpt", two_rank_payloads(a, b)))
    assert torch.equal(full["a"], a) and torch.equal(full["b"], b)


@pytest.mark.parametrize(("damage", "words"), [
    ("missing-rank", r"saved by 2 rank\(s\) but holds the files of ranks \[0\]"),
    ("other-step", "disagree on step"),
    ("overlap", "in more than one ema"),
    ("other-format", "not a zerotrain EMA file"),
    ("nothing", "holds no EMA"),
])
def test_ema_state_dict_refuses_a_damaged_checkpoint(tmp_path, damage, words):
    a, b = torch.randn(4, 6), torch.randn(3)
    payloads = two_rank_payloads(a, b)
    if damage == "missing-rank":
        payloads = payloads[:1]
    elif damage == "other-step":
        payloads[1]["step"] = 8
    elif damage == "overlap":
        payloads[0]["fragments"]["a"] = fragments_of(a, [0, 14])[0]
    elif damage == "other-format":
        payloads[1]["format"] = 99
    elif damage == "nothing":
        payloads = []
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ZerotrainError, match=words):
        ema_state_dict(write(tmp_path / "ckpt", payloads))


class Replicated:
    """A stand-in for DeepSpeed's ZeRO-0 bf16 engine (FP16_Optimizer): bf16 parameters and one flat
    fp32 master per group; a step changes the masters and copies them into the parameters."""

    def __init__(self, seed: int = 0, rank: int = 0, world: int = 1, offload: str | None = None):
        torch.manual_seed(seed)
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).to(torch.bfloat16)
        self.module[1].bias.requires_grad_(False)
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = SimpleNamespace(
            fp16_groups=[params], fp32_groups_flat=[torch.cat([p.detach().float().reshape(-1) for p in params])])
        self.global_rank, self.dp_world_size, self.offload = rank, world, offload

    def zero_optimization_stage(self) -> int:
        return 0

    def zero_offload_optimizer(self) -> object:
        return SimpleNamespace(device=self.offload) if self.offload else None

    def zero_offload_param(self) -> None:
        return None

    def step(self, generator: torch.Generator) -> None:
        flat = self.optimizer.fp32_groups_flat[0]
        flat.add_(torch.randn(flat.shape, generator=generator) * 0.1)
        offset = 0
        for p in self.optimizer.fp16_groups[0]:
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def masters(self) -> dict[str, torch.Tensor]:
        named = {id(p): name for name, p in self.module.named_parameters()}
        flat, offset, held = self.optimizer.fp32_groups_flat[0], 0, {}
        for p in self.optimizer.fp16_groups[0]:
            held[named[id(p)]] = flat[offset:offset + p.numel()].view(p.shape).clone()
            offset += p.numel()
        return held


def test_sharded_ema_on_replicated_masters(tmp_path):
    engine, generator = Replicated(), torch.Generator().manual_seed(3)
    ema = ShardedEMA(engine, decay=0.5, start_step=1)
    reference = engine.masters()
    for step in range(1, 5):
        engine.step(generator)
        ema.update(step)
        for name, master in engine.masters().items():
            reference[name] = master if step <= 1 else 0.5 * reference[name] + 0.5 * master
    path = ema.save(tmp_path, rank=0)
    assert path == tmp_path / "ema-0.pt" and not list(tmp_path.glob("*.tmp"))
    saved = ema_state_dict(tmp_path)
    assert saved.keys() == reference.keys() == {"0.weight", "0.bias", "1.weight"}  # 1.bias is frozen
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-7)

    other = ShardedEMA(Replicated(seed=1), decay=0.5, start_step=1)
    other.load(tmp_path)
    assert other.step == 4
    (tmp_path / "again").mkdir()
    other.save(tmp_path / "again", rank=0)
    assert all(torch.equal(ema_state_dict(tmp_path / "again")[k], saved[k]) for k in saved)


def test_applied_swaps_the_ema_in_and_restores_bit_for_bit():
    engine, generator = Replicated(), torch.Generator().manual_seed(3)
    ema = ShardedEMA(engine, decay=0.5, start_step=0)
    for step in range(1, 4):
        engine.step(generator)
        ema.update(step)
    trained = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    masters = engine.masters()
    with ema.applied():
        inside = engine.module.state_dict()
        for span, value in ema.fragments():
            assert torch.equal(inside[span.name].reshape(-1), value.to(torch.bfloat16)), span.name
        assert not torch.equal(inside["0.weight"], trained["0.weight"])
    assert all(torch.equal(v, trained[k]) for k, v in engine.module.state_dict().items())
    assert all(torch.equal(v, masters[k]) for k, v in engine.masters().items())


def test_applied_refuses_weights_that_are_not_the_masters_rounding():
    engine = Replicated()
    ema = ShardedEMA(engine, decay=0.5, start_step=0)
    with torch.no_grad():
        engine.module[0].weight.add_(1.0)
    with pytest.raises(ZerotrainError, match="not the rounding of the fp32 master"), ema.applied():
        pass


def test_saved_only_by_rank_0_when_every_rank_holds_everything(tmp_path):
    for rank in (0, 1):
        ShardedEMA(Replicated(rank=rank, world=2), decay=0.5, start_step=0).save(tmp_path, rank)
    assert torch.load(tmp_path / "ema-1.pt", weights_only=True)["fragments"] == {}
    assert ema_state_dict(tmp_path).keys() == {"0.weight", "0.bias", "1.weight"}


def test_load_refuses_another_set_of_parameters(tmp_path):
    ShardedEMA(Replicated(), decay=0.5, start_step=0).save(tmp_path, 0)
    engine = Replicated()
    engine.module[0].bias.requires_grad_(False)
    engine.optimizer.fp16_groups = [[engine.module[0].weight, engine.module[1].weight]]
    engine.optimizer.fp32_groups_flat = [torch.cat([p.detach().float().reshape(-1)
                                                    for p in engine.optimizer.fp16_groups[0]])]
    with pytest.raises(ZerotrainError, match=r"unexpected 1, e.g. \['0.bias'\]"):
        ShardedEMA(engine, decay=0.5, start_step=0).load(tmp_path)


def test_nvme_offload_and_unknown_optimizers_are_refused():
    with pytest.raises(ZerotrainError, match="offload_optimizer to NVMe"):
        ShardedEMA(Replicated(offload="nvme"), decay=0.5, start_step=0)
    engine = Replicated()
    engine.optimizer = SimpleNamespace()
    with pytest.raises(ZerotrainError, match="SimpleNamespace .ZeRO stage 0. is not supported"):
        ShardedEMA(engine, decay=0.5, start_step=0)
    with pytest.raises(ZerotrainError, match="ema.decay=1.0"):
        ShardedEMA(Replicated(), decay=1.0, start_step=0)


def test_a_save_on_fewer_ranks_removes_the_files_of_the_missing_ranks(tmp_path):
    torch.save(payload(2, 3, {}), tmp_path / "ema-2.pt")
    ShardedEMA(Replicated(), decay=0.5, start_step=0).save(tmp_path, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ema-0.pt"]
    assert ema_state_dict(tmp_path).keys() == {"0.weight", "0.bias", "1.weight"}
