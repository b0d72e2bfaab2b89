"""Cached greedy decoding timed in alternating rounds (bench/generate_bench.py), and the two
benchmarks built on it: `bench generate`'s decode table and scripts/sparsify_report.py's decode
ratios."""

import importlib.util
from pathlib import Path

import torch

import routeformer as rf
from routeformer.bench.generate_bench import (
    CONCATENATING,
    CachedDecoder,
    _ConcatenatingDecoder,
    bench_decode,
    decode_step_times,
)

REPORT = Path(__file__).resolve().parents[2] / "scripts" / "sparsify_report.py"


def tiny_lm(attention: str = "full") -> rf.CausalLM:
    torch.manual_seed(0)
    config = rf.ModelConfig(vocab_size=16, dim=16, depth=1, heads=2, max_seq_len=64, attention=attention)
    return rf.CausalLM(config).eval()


def test_decoders_take_the_greedy_tokens_of_generate():
    model, prompt = tiny_lm(), torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(1))
    decoder = CachedDecoder.prefill(model, prompt, reserve=12)
    assert decoder.prefill_s > 0 and decoder.cache.length == 8 and decoder.next.shape == (1, 1)
    tokens = [decoder.next]
    for _ in range(3):
        decoder.step()
        tokens.append(decoder.next)
    expected = model.generate(prompt, 4, temperature=0, use_cache=True)[:, 8:]
    assert torch.equal(torch.cat(tokens, dim=1), expected)


def test_decode_step_times_times_every_decoder_in_each_round():
    prompt = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(2))
    decoders = {name: CachedDecoder.prefill(tiny_lm(name), prompt, reserve=16) for name in ("full", "local")}
    times = decode_step_times(decoders, steps=3, warmup=1)
    assert list(times) == ["full", "local"]
    assert all(len(values) == 3 and all(t > 0 for t in values) for values in times.values())
    assert all(decoder.cache.length == 8 + 1 + 3 for decoder in decoders.values())


def test_the_decoder_of_full_before_the_copy_free_cache_decodes_the_same_tokens():
    prompt = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(3))
    full = CachedDecoder.prefill(tiny_lm(), prompt, reserve=12)
    before = _ConcatenatingDecoder.copy_of(full)
    decode_step_times({"full": full, "before": before}, steps=3)
    assert torch.equal(full.next, before.next) and before.cache.length == full.cache.length == 11


def test_bench_decode_rows():
    rows = bench_decode(["full", "local"], [24], new_tokens=3, dim=16, heads=2, memory_steps=1,
                        progress=lambda _: None)
    assert [row["mechanism"] for row in rows] == ["full", CONCATENATING, "local"]
    for row in rows:
        assert row["step_s"] > 0 and row["prefill_s"] > 0 and len(row["step_vs_full"]) == 3
    assert rows[0]["step_vs_full"] == [1.0, 1.0, 1.0]


def test_sparsify_report_decode_ratios():
    spec = importlib.util.spec_from_file_location("sparsify_report", REPORT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    rows = report._decode_ratios(tiny_lm(), tiny_lm("local"), [8, 16], 3, 16)
    assert [row["context"] for row in rows] == [8, 16]
    for row in rows:
        assert set(row) == {"context", "ratio", "dense_ms", "routed_ms"} and len(row["ratio"]) == 3
        assert row["dense_ms"] > 0 and row["routed_ms"] > 0
