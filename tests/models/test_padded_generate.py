"""Padded prompt batches generate with the cache exactly what each prompt generates alone
(models/ragged.py): left padding, right padding, every mechanism that decodes with a cache."""

import pytest
import torch

from routeformer.models.cache import CACHED_MECHANISMS, DecodeCache
from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM
from routeformer.models.ragged import select_rows

VOCAB, NEW = 61, 8
# Small settings so that windows, chunks and routing budgets are smaller than the prompts.
OPTIONS = {"local": {"window": 5}, "linear": {"chunk": 4}, "meta": {"window": 5, "linear_chunk": 4,
           "eval_eta": 0.3, "position_scale": 16.0}, "topk": {"topk": 4, "block": 8}, "mita": {}}


def build(mechanism: str, positions: str = "rotary") -> CausalLM:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, dim=32, depth=2, heads=2, attention=mechanism,
                         attention_options={mechanism: OPTIONS.get(mechanism, {})}, positions=positions,
                         max_seq_len=80)
    model = CausalLM(config).eval()
    for parameter in model.parameters():  # larger weights than the init, so differences show
        parameter.data.normal_(0, 0.3)
    return model


def prompts(lengths=(9, 14, 11), seed=2):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def padded(rows, side):
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        where = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        tokens[index, where], mask[index, where] = row, True
    return tokens, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mechanism", CACHED_MECHANISMS)
def test_a_padded_batch_generates_what_each_prompt_generates_alone(mechanism, side):
    model = build(mechanism)
    rows = prompts()
    tokens, mask = padded(rows, side)
    cached = model.generate(tokens, NEW, temperature=0, mask=mask, use_cache=True)
    uncached = model.generate(tokens, NEW, temperature=0, mask=mask, use_cache=False)
    for index, row in enumerate(rows):
        alone = model.generate(row[None], NEW, temperature=0, use_cache=False)[0, len(row):]
        assert torch.equal(cached[index, -NEW:], alone), (mechanism, side, index)
        assert torch.equal(uncached[index, -NEW:], alone), (mechanism, side, index)
    assert torch.equal(cached[:, :tokens.shape[1]], tokens)  # the prompts come back as given


@pytest.mark.parametrize("mechanism", CACHED_MECHANISMS)
def test_padded_decoding_logits_equal_each_row_alone(mechanism):
    # Logits, not only greedy tokens: a random model can repeat one token and hide a difference.
    model = build(mechanism, positions="learned")
    rows = prompts((9, 14))
    tokens, mask = padded(rows, "left")
    cache = DecodeCache()
    first = model(tokens, cache=cache, mask=mask).logits
    step = torch.tensor([[5], [7]])
    second = model(step, cache=cache).logits[:, 0]
    for index, row in enumerate(rows):
        alone = model(torch.cat([row, step[index]])[None]).logits[0]
        torch.testing.assert_close(first[index, -1], alone[-2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(second[index], alone[-1], atol=1e-5, rtol=1e-5)


def test_beam_style_row_selection_copies_a_row_taken_twice():
    model = build("full")
    tokens, mask = padded(prompts((5, 8)), "left")
    cache = DecodeCache()
    model(tokens, cache=cache, mask=mask)
    state = cache.layers[0]
    select_rows(state, [1, 1, 0])
    assert state["row_lengths"].tolist() == [8, 8, 5]
    first, second = state["rows"][0], state["rows"][1]
    assert first is not second
    assert all(not isinstance(v, torch.Tensor) or v.data_ptr() != second[k].data_ptr()
               for k, v in first.items())


def test_padding_errors_name_the_problem():
    model = build("full")
    tokens, mask = padded(prompts((5, 8)), "left")
    with pytest.raises(ValueError, match="mask must have the prompt's shape"):
        model.generate(tokens, 2, mask=mask[:, 1:])
    empty = mask.clone()
    empty[0] = False
    with pytest.raises(ValueError, match="at least one real token"):
        model.generate(tokens, 2, mask=empty)
    cache = DecodeCache()
    model(tokens, cache=cache)
    with pytest.raises(ValueError, match="padding after an unpadded start"):
        model(tokens[:, :1], cache=cache, mask=torch.tensor([[True], [False]]))
