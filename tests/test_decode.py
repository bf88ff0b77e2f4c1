"""decode.py: compiled decoding runs without autograd (so inductor freezes the weights into the graphs), and
two models of the same shape in one process (a target and a draft) each get their own frozen graphs."""
import torch

import decode
import generate
from helpers import copy_checkpoint


def greedy(engine, prompt, n=12):
    return generate.generate(engine, prompt, n, decode.Sampling(), [], stop_at_eos=False)[0][0]


def test_frozen_graphs_are_not_shared_between_models_of_one_shape(random_target, tmp_path):
    other = copy_checkpoint(random_target, tmp_path / "other", noise=1.0, seed=5)  # same shape, other weights
    first, second = generate.load_model(random_target), generate.load_model(other)
    prompt = torch.tensor([1, 17, 33, 250, 7, 90])
    eager = [greedy(decode.Engine(model), prompt) for model in (first, second)]
    assert eager[0] != eager[1]
    engines = [decode.compile_engine(model, "cpu", compile_prefill=False) for model in (first, second)]
    assert [greedy(engine, prompt) for engine in engines] == eager
    assert [greedy(engine, prompt) for engine in reversed(engines)] == eager[::-1]


def test_generation_runs_without_autograd(random_target, monkeypatch):
    seen = []
    model = generate.load_model(random_target)
    real = decode.decode_one_token

    def watched(*args):
        seen.append(torch.is_grad_enabled())
        return real(*args)

    greedy(decode.Engine(model, decode_one_token=watched), torch.tensor([1, 2, 3]), n=3)
    assert seen and not any(seen)
