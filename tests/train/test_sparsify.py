"""Converting a dense model to a routed one (train/sparsify.py): the copy holds the dense weights and
equals the dense model where topk reads every key; stage 1 trains only the routing parameters and
its KL falls; stage 2 trains every parameter; bad sources and mechanisms are refused."""

import warnings

import pytest
import torch

from routeformer.models.config import ModelConfig
from routeformer.models.heads import CausalLM, TokenPredictor
from routeformer.tasks import build_task
from routeformer.train.sparsify import convert_on_task, sparsify


def _dense(attention="full"):
    torch.manual_seed(0)
    return CausalLM(ModelConfig(vocab_size=16, dim=32, depth=2, heads=2, mlp_ratio=2.0, attention=attention,
                                max_seq_len=32, tie_embeddings=False))


@pytest.fixture(scope="module")
def task():
    return build_task("mqar", seq_len=32, pairs=4, vocab_size=16)


def test_the_copy_holds_the_dense_weights_and_names_the_routing_parameters():
    dense = _dense()
    routed = sparsify(dense, "topk", options={"topk": 8})
    assert type(routed) is CausalLM and routed.config.attention == "topk"
    state = routed.state_dict()
    for name, tensor in dense.state_dict().items():
        assert torch.equal(state[name], tensor), name
    assert routed.new_parameters and all(".attention.router." in name for name in routed.new_parameters)
    names = {name for name, _ in routed.named_parameters()}
    assert set(routed.new_parameters) == names - set(dense.state_dict())


def test_with_every_key_read_the_converted_model_is_the_dense_one():
    dense = _dense().eval()
    tokens = torch.randint(0, 16, (3, 32), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # K >= T: the layer warns it is full attention
        routed = sparsify(dense, "topk", options={"topk": 32}).eval()
        torch.testing.assert_close(routed(tokens).logits, dense(tokens).logits, rtol=1e-5, atol=1e-5)
    short = sparsify(dense, "topk", options={"topk": 2}).eval()
    assert not torch.allclose(short(tokens).logits, dense(tokens).logits, atol=1e-3)


def test_stage_one_trains_only_the_router_and_its_kl_falls(task):
    dense = _dense()
    before = {name: tensor.clone() for name, tensor in dense.state_dict().items()}
    routed, record = convert_on_task(dense, task, "topk", options={"topk": 4}, steps=30, batch_size=16,
                                     evals=3, validation_sequences=32, seed=3)
    after = routed.state_dict()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name  # every dense parameter bit-identical
        assert torch.equal(dense.state_dict()[name], tensor), name  # the source is untouched
    initial = sparsify(dense, "topk", options={"topk": 4})
    assert any(not torch.equal(after[name], initial.state_dict()[name]) for name in record["new_parameters"])
    kl = [entry["aux_loss"] for entry in record["stages"]["dense_warmup"]["history"]]
    assert len(kl) == 3 and kl[-1] < kl[0]
    assert record["options"]["distill_dense_steps"] == 30 and record["tokens"] == 30 * 16 * 32
    assert int(routed.backbone.blocks[0].attention.distill_step) == 30
    assert all(parameter.requires_grad for parameter in routed.parameters())


def test_stage_two_trains_every_parameter_and_is_deterministic(task):
    dense = _dense()
    runs = [convert_on_task(dense, task, "topk", options={"topk": 4}, steps=4, sparse_steps=4, batch_size=8,
                            evals=1, validation_sequences=16, seed=5) for _ in range(2)]
    (first, record), (second, _) = runs
    warmed, _ = convert_on_task(dense, task, "topk", options={"topk": 4}, steps=4, batch_size=8, evals=1,
                                validation_sequences=16, seed=5)
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    trained = first.state_dict()
    changed = [name for name, tensor in dense.state_dict().items() if not torch.equal(trained[name], tensor)]
    assert "backbone.blocks.0.attention.qkv_proj.weight" in changed and "lm_head.weight" in changed
    assert set(record["stages"]) == {"dense_warmup", "sparse"}
    assert record["tokens"] == (4 + 4) * 8 * 32
    assert not torch.equal(first.state_dict()["lm_head.weight"], warmed.state_dict()["lm_head.weight"])


def test_a_token_predictor_converts_to_its_own_class():
    torch.manual_seed(0)
    dense = TokenPredictor(ModelConfig(vocab_size=16, dim=32, depth=1, heads=2, causal=False, max_seq_len=16))
    assert type(sparsify(dense, "topk", options={"topk": 4})) is TokenPredictor


def test_sources_without_dense_attention_and_mechanisms_that_do_not_convert_are_refused():
    with pytest.raises(ValueError, match=r"source layer 0 runs 'local'.*no dense attention to copy"):
        sparsify(_dense("local"), "topk")
    with pytest.raises(ValueError, match=r"source layer 1 runs 'topk'"):
        sparsify(_dense(["full", "topk"]), "topk")
    with pytest.raises(ValueError, match=r"'local' does not convert.*\['topk', 'meta', 'mita'\]"):
        sparsify(_dense(), "local")
    with pytest.raises(ValueError, match=r"'nope' is not registered"):
        sparsify(_dense(), "nope")


def test_bad_stage_arguments_are_refused(task):
    with pytest.raises(ValueError, match=r"routing_learning='score_bias'.*'distill'"):
        convert_on_task(_dense(), task, "topk", options={"routing_learning": "score_bias"}, steps=2)
    with pytest.raises(ValueError, match=r"distill_dense_steps: set by the conversion"):
        convert_on_task(_dense(), task, "topk", options={"distill_dense_steps": 3}, steps=2)
    with pytest.raises(ValueError, match=r"steps must be >= 1: a 'topk' model has routing parameters"):
        convert_on_task(_dense(), task, "topk", steps=0)
    with pytest.raises(ValueError, match=r"steps must be an integer >= 0; got -1"):
        convert_on_task(_dense(), task, "topk", steps=-1)
    with pytest.raises(ValueError, match=r"steps must be 0: a 'mita' model has no parameters of its own"):
        convert_on_task(_dense(), task, "mita", steps=2, sparse_steps=2)
    with pytest.raises(ValueError, match=r"sparse_steps must be >= 1: a 'mita' model has nothing"):
        convert_on_task(_dense(), task, "mita", steps=0)


def test_meta_copies_the_dense_projections_into_every_expert_and_warms_up_its_controller(task):
    dense = _dense()
    routed, record = convert_on_task(dense, task, "meta", steps=6, batch_size=8, evals=1,
                                     validation_sequences=16, seed=2)
    state, initial = routed.state_dict(), sparsify(dense, "meta").state_dict()
    for block in range(2):
        prefix = f"backbone.blocks.{block}.attention."
        for expert in range(3):
            for dense_name, routed_name in (("qkv_proj", "expert_qkv"), ("out_proj", "expert_out")):
                assert torch.equal(state[f"{prefix}{routed_name}.{expert}.weight"],
                                   dense.state_dict()[f"{prefix}{dense_name}.weight"])
    assert record["new_parameters"] and all(".attention.router." in name for name in record["new_parameters"])
    assert any(not torch.equal(state[name], initial[name]) for name in record["new_parameters"])
    assert set(record["stages"]) == {"dense_warmup"} and record["tokens"] == 6 * 8 * 32


def test_mita_converts_with_the_dense_weights_and_fine_tunes_them(task):
    dense = _dense()
    copy = sparsify(dense, "mita")
    assert copy.new_parameters == []
    for name, tensor in dense.state_dict().items():
        assert torch.equal(copy.state_dict()[name], tensor), name
    routed, record = convert_on_task(dense, task, "mita", steps=0, sparse_steps=3, batch_size=8, evals=1,
                                     validation_sequences=16, seed=1)
    assert set(record["stages"]) == {"sparse"} and record["tokens"] == 3 * 8 * 32
    name = "backbone.blocks.0.attention.qkv_proj.weight"
    assert not torch.equal(routed.state_dict()[name], dense.state_dict()[name])


def test_run_tokens_counts_every_stage_at_its_own_length():
    from routeformer.train.sparsify import run_tokens

    config = {"setup": {"schedule": {"steps": 30, "batch_size": 2, "lr": 1e-3},
                        "curriculum": [{"options": {"seq_len": 256, "documents": "stream"},
                                        "schedule": {"steps": 100, "batch_size": 32}},
                                       {"options": {"seq_len": 1024},
                                        "schedule": {"steps": 50, "batch_size": 8}}]}}
    assert run_tokens(config, 4096) == 100 * 32 * 256 + 50 * 8 * 1024 + 30 * 2 * 4096
    assert run_tokens({"setup": {"schedule": {"steps": 20, "batch_size": 16}}}, 32) == 20 * 16 * 32
    assert run_tokens({}, 32) is None
