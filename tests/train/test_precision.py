"""train.precision: bf16 autocast trains (toy size, `full`); fp16 needs CUDA."""

import pytest
import torch

from routeformer.models.heads import TokenPredictor
from routeformer.train import train
from tests.train.runs import quick_config


def test_bf16_runs_the_forward_under_autocast_and_trains_close_to_fp32(tmp_path, monkeypatch):
    run = ("--steps", "20", "--final_eval_tokens", "8192")  # 8k test tokens: a steady estimate
    fp32 = train(quick_config(tmp_path / "fp32", *run), quiet=True)
    forward, seen = TokenPredictor.forward, []

    def recording(self, *args, **kwargs):
        if self.training:
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TokenPredictor, "forward", recording)
    bf16 = train(quick_config(tmp_path / "bf16", *run, "--precision", "bf16"), quiet=True)
    assert set(seen) == {(True, torch.bfloat16)} and len(seen) == 20
    assert bf16.skipped_steps == 0
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # weights stay fp32
    assert abs(bf16.final_eval["loss"] - fp32.final_eval["loss"]) < 0.05
    assert bf16.final_eval["loss"] < 3.8  # it learned: the untrained model is at ~4.6 nats


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only without CUDA")
def test_fp16_without_cuda_is_refused(tmp_path):
    with pytest.raises(ValueError, match="train.precision='fp16' needs a CUDA device"):
        train(quick_config(tmp_path / "run", "--precision", "fp16"), quiet=True)
