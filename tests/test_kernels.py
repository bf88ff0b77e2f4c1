"""kernels.py: the CPU kernel choice changes how a product is computed, never what it computes: column-major
weights, oneDNN-packed copies where they measure faster (and never inside frozen whole graphs), state dicts and tied
weights unchanged."""
import pytest
import torch

import kernels
from test_model import MAX_SEQ, SHAPES, assert_close, full_forward, tiny_model, tokens


# ----------------------------------------------------------------------------- weight layout

@pytest.mark.parametrize("shape", ["gqa", "tied-llama3"])
def test_fast_weight_layout_keeps_logits_state_dict_and_tied_weights(shape):
    """use_fast_weight_layout changes strides only: fp32 logits equal the checkpoint layout's up to rounding,
    state_dict keys, shapes and values are unchanged, and a tied output still shares the embedding."""
    model, original = tiny_model(**SHAPES[shape]), tiny_model(**SHAPES[shape])
    before = {name: t.clone() for name, t in model.state_dict().items()}
    kernels.use_fast_weight_layout(model)
    assert model.output.weight.stride() == (1, model.output.weight.shape[0])  # fp32 on CPU: column-major
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[name], before[name]) for name in before)
    if model.args.tie_word_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    ids = tokens(20, batch=2)
    assert_close(full_forward(model, ids), full_forward(original, ids))
    model.setup_caches(2, MAX_SEQ)
    with torch.no_grad():  # one-token decode, the product the layout is chosen for
        assert_close(model(ids[:, :1], torch.zeros(2, 1, dtype=torch.long)),
                     full_forward(original, ids[:, :1]))


def test_bf16_weights_keep_their_layout():
    model = tiny_model(**SHAPES["gqa"]).to(torch.bfloat16)
    kernels.use_fast_weight_layout(model)
    assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.parametrize("faster", [True, False], ids=["onednn-faster", "mkl-faster"])
def test_onednn_packing_follows_the_measurement_and_keeps_logits(monkeypatch, faster):
    """use_fast_weight_layout packs a float32 linear for oneDNN exactly where onednn_is_faster says so; products of
    several rows then run on the packed copy (F.linear is not called), one row keeps F.linear; logits equal the
    unpacked model's up to float32 rounding; the state dict has no packed entry; bf16 is never packed."""
    import model as model_module
    monkeypatch.setattr(kernels, "onednn_is_faster", lambda out_features, in_features: faster)
    model, original = tiny_model(**SHAPES["tied-llama3"]), tiny_model(**SHAPES["tied-llama3"])
    keys = list(model.state_dict())
    kernels.use_fast_weight_layout(model)
    linears = [m for m in model.modules() if isinstance(m, model_module.Linear)]
    assert linears and all((m.packed is not None) == faster for m in linears)
    assert list(model.state_dict()) == keys and model.output.weight is model.tok_embeddings.weight
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(model_module.F, "linear", lambda x, w: calls.append(x.shape) or real(x, w))
    ids = tokens(20, batch=2)
    want, want_first = full_forward(original, ids), full_forward(original, ids[:, :1])
    calls.clear()
    assert_close(full_forward(model, ids), want)
    assert (calls == []) == faster
    model.setup_caches(2, MAX_SEQ)
    with torch.no_grad():  # one token a row: 2 rows, so still packed; then one row
        assert_close(model(ids[:, :1], torch.zeros(2, 1, dtype=torch.long)), want_first)
        assert (calls == []) == faster
        model(ids[:1, :1], torch.zeros(1, 1, dtype=torch.long))
    assert len(calls) >= len(linears) - 1  # every layer's one-row product went through F.linear
    bf16 = tiny_model(**SHAPES["gqa"]).to(torch.bfloat16)
    kernels.use_fast_weight_layout(bf16)
    assert all(m.packed is None for m in bf16.modules() if isinstance(m, model_module.Linear))


def test_frozen_whole_graphs_trace_f_linear(monkeypatch):
    """Under compile_engine's freezing (whole graphs, CPU) compiled graphs trace F.linear (which inductor multiplies
    with its own kernels on weights it packs itself) while eager forwards keep the packed copy."""
    import decode
    import model as model_module
    monkeypatch.setattr(kernels, "onednn_is_faster", lambda out_features, in_features: True)
    model = tiny_model(**SHAPES["gqa"])
    kernels.use_fast_weight_layout(model)
    decode.compile_engine(model, "cpu", "whole")  # turns freezing on; compiles lazily
    linears = [m for m in model.modules() if isinstance(m, model_module.Linear)]
    assert linears and all(m.packed is not None for m in linears)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    model.setup_caches(2, MAX_SEQ)
    ids, input_pos = tokens(3, batch=2), torch.arange(3).expand(2, 3)
    calls, real = [], model_module.packed_linear
    monkeypatch.setattr(model_module, "packed_linear", lambda x, packed: calls.append(x.shape) or real(x, packed))
    with torch.no_grad():
        want = model(ids, input_pos)  # eager: the packed copies
        assert len(calls) == len(linears)
        torch._dynamo.reset()
        assert_close(torch.compile(model, backend=backend, fullgraph=True)(ids, input_pos), want)
    assert "packed_linear" not in graphs[0] and "linear" in graphs[0]


def test_onednn_is_faster_is_measured_once_per_shape():
    kernels.onednn_is_faster.cache_clear()
    first = kernels.onednn_is_faster(96, 64)
    assert isinstance(first, bool) and kernels.onednn_is_faster(96, 64) is first
    assert kernels.onednn_is_faster.cache_info().hits == 1
