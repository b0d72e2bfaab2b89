"""A dense transformers Llama converted to topk by sparsify_pretrained: stage 1 trains the router
alone (every other weight bit-identical) and lowers its KL to dense attention; the converted model
saves, reloads through the Auto classes with the same outputs, and its cached generation equals the
uncached one (tiny models built from a config, no downloads)."""

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from routeformer.integrations.hf import (  # noqa: E402
    patch_attention,
    routeformer_layers,
    sparsify_pretrained,
)
from routeformer.integrations.hf.sparsify import routing_parameters  # noqa: E402
from tests.integrations.test_hf import VOCAB, llama  # noqa: E402

LENGTH = 32


def pattern_batches(count, seed=0, batch=4):
    """Sequences that repeat a random 8-token phrase: something for attention to learn to copy."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        phrase = torch.randint(1, VOCAB, (batch, 8), generator=generator)
        yield phrase.repeat(1, LENGTH // 8)


def trained_dense(steps=30):
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for ids in pattern_batches(steps, seed=1):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_stage_one_trains_the_router_alone_and_lowers_its_kl():
    dense = trained_dense()
    reference = patch_attention(trained_dense(), "topk", topk=4, block=8)  # the same weights, patched
    model, record = sparsify_pretrained(dense, "topk", pattern_batches(40), steps=40, topk=4, block=8)
    assert record["steps"] == 40 and record["tokens"] == 40 * 4 * LENGTH
    assert record["options"]["routing_learning"] == "distill"
    assert record["options"]["distill_dense_steps"] == 40
    assert sum(record["stage1_kl"][-5:]) < sum(record["stage1_kl"][:5])
    routing = set(routing_parameters(model))
    assert routing and all(".router." in name for name in routing)
    before = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        if name not in routing:  # dense weights bit-identical after stage 1
            assert torch.equal(parameter, before[name]), name
    assert all(p.requires_grad for p in model.parameters())  # left trainable as it came


def test_the_converted_model_saves_reloads_and_decodes_as_it_computes(tmp_path):
    model, record = sparsify_pretrained(trained_dense(), "topk", pattern_batches(30), steps=20,
                                        sparse_steps=10, topk=4, block=8)
    assert len(record["stage2_loss"]) == 10 and record["tokens"] == 30 * 4 * LENGTH
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert routeformer_layers(loaded)[0].layer.topk == 4
    ids = next(pattern_batches(1, seed=5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
    prompt = ids[:, :12]
    common = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    cached = loaded.generate(prompt, use_cache=True, **common)
    assert torch.equal(cached, loaded.generate(prompt, use_cache=False, **common))


def test_wrong_conversions_are_refused_by_name():
    with pytest.raises(ValueError, match="mechanism 'mita' does not convert"):
        sparsify_pretrained(llama(), "mita", pattern_batches(2), steps=2)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        sparsify_pretrained(llama(), "topk", pattern_batches(2), steps=0)
    with pytest.raises(ValueError, match="option distill_dense_steps: set by the conversion"):
        sparsify_pretrained(llama(), "topk", pattern_batches(2), steps=2, distill_dense_steps=5)
    with pytest.raises(ValueError, match="batches: ran out after 2 of the 3 steps"):
        sparsify_pretrained(llama(), "topk", pattern_batches(2), steps=3, topk=4)
    with pytest.raises(TypeError, match="batches: each batch must be a LongTensor"):
        sparsify_pretrained(llama(), "topk", [[1, 2, 3]], steps=1, topk=4)
