"""Bits per character per position bucket: the buckets, and evaluate_on_task's record."""

import math

import pytest
import torch

from routeformer.tasks import build_task
from routeformer.tasks.positions import PositionBucketSums, position_buckets
from routeformer.train.on_task import ModelSpec, build_task_model, evaluate_on_task


def test_default_buckets_are_clipped_to_the_window():
    assert position_buckets(2048) == [(0, 256), (256, 1024), (1024, 2048)]
    assert position_buckets(4096) == [(0, 256), (256, 1024), (1024, 2048), (2048, 4096)]
    assert position_buckets(300) == [(0, 256), (256, 300)]
    assert position_buckets(64) == [(0, 64)]
    assert position_buckets(200_000)[-1] == (131072, 200_000)
    assert position_buckets(100, [0, 10, 50, 1000]) == [(0, 10), (10, 50), (50, 100)]
    for bad in ([], [1, 10], [0, 10, 10], [0, 5.5], [0, 20, 10]):
        with pytest.raises(ValueError, match="position_buckets must be strictly increasing integers"):
            position_buckets(100, bad)


def test_bucket_sums_follow_the_label_order():
    labels = torch.tensor([[1, -100, 2, 3], [-100, 4, 5, 6]])
    sums = PositionBucketSums(4, [0, 2])
    sums.add(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), labels)  # slots 0, 2, 3, 1, 2, 3
    assert sums.token_counts() == {"0-2": 2, "2-4": 4}
    assert sums.bits()["0-2"] == pytest.approx((1.0 + 4.0) / 2 / math.log(2))
    assert sums.bits()["2-4"] == pytest.approx((2.0 + 3.0 + 5.0 + 6.0) / 4 / math.log(2))


def test_lm_records_bits_per_position_whose_weighted_mean_is_the_total():
    task = build_task("lm", seq_len=48)
    torch.manual_seed(0)
    model = build_task_model(task, "full", {}, ModelSpec(dim=16, depth=1, heads=2))
    plain = evaluate_on_task(model, task, "test", 6, batch_size=4)
    record = evaluate_on_task(model, task, "test", 6, batch_size=4, position_buckets=[0, 8, 32])
    for key in ("loss", "accuracy", "attention_flops_per_token", "bits_per_char"):
        assert record[key] == plain[key]  # the keys of before, the same values
    assert list(record["bits_per_char_by_position"]) == ["0-8", "8-32", "32-48"]
    counts = record["tokens_by_position"]
    assert counts == {"0-8": 6 * 8, "8-32": 6 * 24, "32-48": 6 * 16}
    mean = sum(record["bits_per_char_by_position"][k] * n for k, n in counts.items()) / sum(counts.values())
    assert mean == pytest.approx(record["bits_per_char"], rel=1e-6)
    assert list(plain["bits_per_char_by_position"]) == ["0-48"]  # default edges clipped to T=48
    assert plain["bits_per_char_by_position"]["0-48"] == pytest.approx(plain["bits_per_char"], rel=1e-6)


def test_meta_tokens_and_non_lm_tasks():
    task = build_task("lm", seq_len=32, meta_density=0.25)
    torch.manual_seed(0)
    model = build_task_model(task, "full", {}, ModelSpec(dim=16, depth=1, heads=2))
    record = evaluate_on_task(model, task, "validation", 4, position_buckets=[0, 16])
    asked = int((task.fixed_sample("validation", 4)[1] != -100).sum())
    assert sum(record["tokens_by_position"].values()) == asked < 4 * 32  # no loss at meta-tokens
    mqar = build_task("mqar")
    mqar_model = build_task_model(mqar, "full", {}, ModelSpec(dim=16, depth=1, heads=2))
    assert "bits_per_char_by_position" not in evaluate_on_task(mqar_model, mqar, "test", 8)
    with pytest.raises(ValueError, match="position_buckets applies to LM tasks"):
        evaluate_on_task(mqar_model, mqar, "test", 8, position_buckets=[0, 8])
