"""transformers drift cannot be silent: the tested range is one fact (compat.TESTED_RANGE = the
extras = the oldest release .ci/run installs), a release outside it refuses cached generation with
one line while uncached generation works, and a cache handed over under a new name raises."""

import re
import tomllib
from pathlib import Path

import pytest
import torch

from tests.extras import require

transformers = require("transformers", "hf")

from transformers import DynamicCache  # noqa: E402

from routeformer.integrations.hf import (  # noqa: E402
    RouteformerConfig,
    RouteformerForCausalLM,
    compat,  # noqa: E402
    patch_attention,
)
from routeformer.integrations.hf.patch import routeformer_layers  # noqa: E402
from tests.integrations.test_hf import gpt2  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version, tested", [
    ("5.20.0", True), ("5.22.2", True), ("5.23.0", True), ("5.24.0", True), ("5.24.3", True),
    ("5.24.0+cpu", True), ("5.19.0", False), ("5.25.0", False), ("5.25.0.dev0", False), ("5.24", True),
    ("6.0.0", False), ("4.57.6", False),
])
def test_untested_reason_names_releases_outside_the_range(version, tested):
    reason = compat.untested_reason(version)
    assert (reason is None) == tested
    if not tested:
        assert version in reason and compat.TESTED_RANGE[0] in reason


def test_the_extras_and_ci_name_the_tested_range():
    low, high = compat.TESTED_RANGE
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("hf", "test"):
        pins = [p for p in project[extra] if p.startswith("transformers")]
        assert pins == [f"transformers>={low},<{high}"], (extra, pins)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "TESTED_RANGE[0]" in ci and "tests/integrations" in ci, "CI must also test the oldest release"


def test_the_installed_release_is_in_the_tested_range():
    # The suite runs on the newest (pip's pick) and the oldest (.ci/run) release of the range.
    assert compat.untested_reason() is None, compat.untested_reason()


def _ids():
    return torch.randint(1, 50, (1, 24), generator=torch.Generator().manual_seed(0))


def test_an_untested_release_refuses_cached_generation_in_one_line(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    model = patch_attention(gpt2(), "full")
    assert not model.config.use_cache and not model.generation_config.use_cache
    plain = model.generate(_ids(), max_new_tokens=4, do_sample=False, pad_token_id=0)  # uncached: works
    assert plain.shape == (1, 28)
    with pytest.raises(ValueError, match=r"transformers 5\.25\.0 is outside .*pass use_cache=False") as error:
        model.generate(_ids(), max_new_tokens=4, do_sample=False, pad_token_id=0, use_cache=True)
    assert "\n" not in str(error.value)


def test_routeformer_model_under_an_untested_release_runs_uncached_and_refuses_a_cache(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    model = RouteformerForCausalLM(RouteformerConfig(vocab_size=50, dim=32, depth=1, heads=4)).eval()
    assert model(_ids()).logits.shape == (1, 24, 50)  # a plain forward makes no cache
    with pytest.raises(ValueError, match="outside .*pass use_cache=False"):
        model(_ids(), cache=DynamicCache())


def test_a_cache_under_an_unknown_argument_name_raises():
    # What a future rename would look like: the module must not run on without the cache.
    model = patch_attention(gpt2(), "full")
    attention = routeformer_layers(model)[0]
    hidden = torch.randn(1, 3, model.config.hidden_size)
    with pytest.raises(ValueError, match=r"passed a Cache as argument 'kv_cache'"):
        attention(hidden, kv_cache=DynamicCache())
    with pytest.raises(ValueError, match="positional argument 0"):
        attention(hidden, DynamicCache())
    with pytest.raises(ValueError, match="both cache and past_key_values"):
        attention(hidden, cache=DynamicCache(), past_key_values=DynamicCache())


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_cache_is_read_under_both_names(name):
    # transformers >= 5.24 passes `cache`, 5.23 `past_key_values`: the module decodes under either.
    model = patch_attention(gpt2(), "full").eval()
    attention = routeformer_layers(model)[0]
    hidden = torch.randn(1, 5, model.config.hidden_size)
    whole = attention(hidden)[0]
    cache = DynamicCache()
    first = attention(hidden[:, :3], **{name: cache})[0]
    rest = attention(hidden[:, 3:], position_ids=torch.arange(3, 5)[None], **{name: cache})[0]
    assert cache.get_seq_length() == 5
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=1e-5, rtol=1e-5)


def test_the_readme_example_from_the_issue_is_exact():
    # The report's reproduction: GPT-2 patched with full, greedy, 16 new tokens, batch 1 and 2.
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=97, n_positions=128,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = patch_attention(transformers.AutoModelForCausalLM.from_config(config).eval(), "full")
    for batch in (1, 2):
        ids = torch.randint(1, 97, (batch, 24), generator=torch.Generator().manual_seed(1))
        kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, use_cache=True, **kwargs),
                           model.generate(ids, use_cache=False, **kwargs))


def test_compat_is_the_only_reader_of_the_cache_argument():
    # One place decides how the cache is handed over (docs/integrations.md, "transformers internals").
    source = ROOT / "src" / "routeformer" / "integrations" / "hf"
    for path in source.glob("*.py"):
        if path.name == "compat.py":
            continue
        assert not re.search(r"kwargs\.get\(['\"](cache|past_key_values)", path.read_text()), path.name
