"""decode.py: compiled decoding equals eager decoding in both compile modes (one compiled block shared by every
layer and every model of its shape, or the whole model in one graph with its weights frozen in), two models of
the same shape in one process (a target and a draft) never get each other's weights, and generation runs
without autograd (so that inductor can freeze weights into whole-model graphs)."""
import os

import pytest
import torch

import compilation
import decode
import generation
from errors import UserError
from helpers import copy_checkpoint
from model import ModelArgs, Transformer


def greedy(engine, prompt, n=12):
    return generation.generate(engine, prompt, n, decode.Sampling(), [], stop_at_eos=False)[0][0]


@pytest.mark.parametrize("mode", ["regional", pytest.param("whole", marks=pytest.mark.slow)])
def test_models_of_one_shape_never_share_weights_through_compiled_graphs(random_target, tmp_path, mode):
    other = copy_checkpoint(random_target, tmp_path / "other", noise=1.0, seed=5)  # same shape, other weights
    first, second = generation.load_model(random_target), generation.load_model(other)
    prompt = torch.tensor([1, 17, 33, 250, 7, 90])
    eager = [greedy(decode.Engine(model), prompt) for model in (first, second)]
    assert eager[0] != eager[1]
    torch._dynamo.reset()
    engines = [decode.compile_engine(model, "cpu", mode) for model in (first, second)]
    assert [greedy(engine, prompt) for engine in engines] == eager
    assert [greedy(engine, prompt) for engine in reversed(engines)] == eager[::-1]


def test_regional_compilation_compiles_one_block_for_all_layers():
    """Six layers, two models: one graph for the block, one for the sampling head, none per layer or model."""
    from torch._dynamo.utils import counters
    args = ModelArgs(dim=64, n_layer=6, n_head=4, n_local_heads=2, vocab_size=128, block_size=64)
    models = [Transformer(args).eval().requires_grad_(False) for _ in range(2)]
    torch._dynamo.reset()
    counters.clear()
    prompt = torch.tensor([1, 2, 3, 4])
    for model in models:
        compiled = greedy(decode.compile_engine(model, "cpu", "regional"), prompt)
        assert compiled == greedy(decode.Engine(model), prompt)
    assert counters["stats"]["unique_graphs"] == 2


def test_auto_compile_mode_stores_graphs_of_checkpoints():
    """auto and autotune store their graphs for a model loaded from a file (no tensor parallelism), on CPU and CUDA;
    a model built in code has no place to store them and compiles regionally on CPU, whole (CUDA graphs) on CUDA;
    the other modes are kept as asked, and an unknown one is refused with one line."""
    assert compilation.resolve_mode("auto", "cpu") == "stored"
    assert compilation.resolve_mode("autotune", "cpu") == "stored-autotune"
    assert compilation.resolve_mode("auto", "cuda") == "stored"
    assert compilation.resolve_mode("autotune", "cuda:1") == "stored-autotune"
    assert compilation.resolve_mode("auto", "cpu", storable=False) == "regional"
    assert compilation.resolve_mode("auto", "cuda", storable=False) == "whole"
    assert compilation.resolve_mode("autotune", "cpu", storable=False) == "autotune"
    assert compilation.resolve_mode("whole", "cpu") == "whole"
    assert compilation.resolve_mode("regional", "cpu") == "regional"
    with pytest.raises(UserError, match="fastest"):
        compilation.resolve_mode("fastest", "cpu")
    in_code = Transformer(ModelArgs(dim=32, n_layer=2, n_head=2, vocab_size=64, block_size=32))
    # a regional engine runs the model with the compiled block, not a compiled model
    assert not isinstance(decode.compile_engine(in_code, "cpu").forward, torch._dynamo.eval_frame.OptimizedModule)
    assert decode.compile_engine(in_code, "cpu").mode == "regional"


@pytest.mark.parametrize("mode", ["regional", pytest.param("whole", marks=pytest.mark.slow)])
def test_compiled_verification_forward_equals_eager(random_target, mode):
    """engine.forward with an explicit tree mask (speculative verification) gives the eager logits."""
    model = generation.load_model(random_target)
    engine = decode.compile_engine(model, "cpu", mode)
    model.setup_caches(1, 32)
    prefix, nodes = torch.tensor([[1, 17, 33, 250]]), torch.tensor([[7, 90, 91, 5]])
    parents = [-1, 0, 0, 1]  # node 0 follows the prefix; nodes 1 and 2 are its children; node 3 follows node 1
    depths = torch.tensor([[1, 2, 2, 3]])
    mask = torch.zeros(1, 1, 4, 32, dtype=torch.bool)
    mask[..., :4] = True
    for i, parent in enumerate(parents):
        node = i
        while node >= 0:
            mask[0, 0, i, 4 + node] = True
            node = parents[node]
    slots, positions = torch.arange(4, 8).view(1, -1), 3 + depths
    with torch.no_grad():
        model(prefix, torch.arange(4).view(1, -1))
        want = model(nodes, positions, slots, mask)
        got = engine.forward(nodes, positions, slots, mask)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


@pytest.mark.slow  # compiles a whole graph
@pytest.mark.gemm_templates
def test_whole_graphs_of_float_models_use_inductors_gemm_templates(random_target, tmp_path):
    """On CPU the whole graphs of a float32 or bf16 model multiply with inductor's C++ GEMM templates without
    timing them (graph_options); a quantized model keeps the default lowering of its int8 / int4 products, a
    compile mode (CUDA graphs, autotune) is passed on as it is; the templates' tokens equal eager decoding's."""
    import quantize
    model = generation.load_model(random_target)
    assert compilation.graph_options(model, "cpu", "whole") == {"options": compilation.CPP_GEMM_OPTIONS}
    assert compilation.graph_options(model.to(torch.bfloat16), "cpu", "whole") == {"options": compilation.CPP_GEMM_OPTIONS}
    assert compilation.graph_options(model, "cpu", "autotune") == {"mode": "max-autotune"}
    assert compilation.graph_options(model, "cuda", "whole") == {"mode": "reduce-overhead"}
    quantize.apply_quantization_scheme(model, {"mode": "int8"})
    assert compilation.graph_options(model, "cpu", "whole") == {}
    from torch._dynamo.utils import counters
    model = generation.load_model(random_target)
    prompt = torch.tensor([1, 17, 33, 250, 7, 90])
    eager = greedy(decode.Engine(model), prompt)
    torch._dynamo.reset()
    counters.clear()
    engine = decode.compile_engine(model, "cpu", "whole")
    assert engine.options == {"options": compilation.CPP_GEMM_OPTIONS}  # what Engine.compile compiles other functions with
    assert decode.compile_engine(model, "cpu", "regional").compile(decode.decode_one_token) is None
    assert greedy(engine, prompt) == eager
    assert counters["inductor"]["cpp_templated_kernel_counter"] > 0  # the products are the templates' kernels
    assert counters["inductor"]["select_algorithm_autotune"] == 0  # and nothing was timed: one choice each


def test_stored_graph_options_per_mode():
    """What each stored mode asks of inductor: never the weights inside the library, and nothing frozen (a graph
    reads the module's own tensors); every candidate timed under autotune; a quantized model keeps its int8 / int4
    kernels, which have threads of their own, and inductor's kernels beside them run on one. (Each mode's tokens
    equal eager decoding's: tests/test_stored.py builds the auto graph end to end; an autotuned build times every
    candidate kernel, a minute even for a one-layer model, so it is not rebuilt here.)"""
    weightless = {"aot_inductor.package_constants_in_so": False}
    model = Transformer(ModelArgs(dim=32, n_layer=1, n_head=2, vocab_size=64, block_size=32))
    assert compilation.stored_options(model, "stored") == {**weightless, "freezing": False}
    assert compilation.stored_options(model, "stored-autotune") == {**weightless, "freezing": False, "max_autotune": True}
    int8 = Transformer(ModelArgs(dim=32, n_layer=1, n_head=2, vocab_size=64, block_size=32)).requires_grad_(False)
    int8.layers[0].feed_forward.w1.weight.data = int8.layers[0].feed_forward.w1.weight.data.to(torch.int8)
    assert compilation.stored_options(int8, "stored") == {**weightless, "freezing": False, "cpp.threads": 1}
    assert compilation.stored_options(int8, "stored-autotune") == {**weightless, "freezing": False,
                                                                  "max_autotune": True, "cpp.threads": 1}
    # CUDA: the kernels' binaries inside the one library that is signed and loaded; no CPU options
    assert compilation.stored_options(model, "stored", "cuda") == {**weightless, "aot_inductor.embed_kernel_binary": True}
    assert compilation.stored_options(int8, "stored-autotune", "cuda:0") == {
        **weightless, "aot_inductor.embed_kernel_binary": True, "max_autotune": True}


def test_generation_runs_without_autograd(random_target, monkeypatch):
    seen = []
    model = generation.load_model(random_target)
    real = decode.decode_one_token

    def watched(*args):
        seen.append(torch.is_grad_enabled())
        return real(*args)

    greedy(decode.Engine(model, decode_one_token=watched), torch.tensor([1, 2, 3]), n=3)
    assert seen and not any(seen)


def test_a_forced_cpu_capability_gets_an_inductor_cache_of_its_own(monkeypatch):
    """Inductor's FX graph cache is keyed without ATEN_CPU_CAPABILITY: a run forcing it (avx2 on an AVX-512 CPU) and
    a plain run must not share kernels generated for one instruction set and built for the other (they wrote past
    their buffers). A cache directory the user named wins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compilation.configure_compiler.cache_clear()
    compilation.configure_compiler("cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() + "-avx2"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    compilation.configure_compiler.cache_clear()
    compilation.configure_compiler("cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"
    compilation.configure_compiler.cache_clear()


def test_compile_engine_skips_inductors_vector_isa_probe(random_target, monkeypatch):
    """On an AVX2 / AVX-512 CPU the engine tells inductor to use the vector ISA ATen runs instead of proving with a C++
    build per ISA in each process (most of a cold compile); a TORCHINDUCTOR_VEC_ISA_OK of the user's wins."""
    import torch._inductor.config as inductor_config
    model = generation.load_model(random_target)
    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", None)
    monkeypatch.delenv("TORCHINDUCTOR_VEC_ISA_OK", raising=False)
    compilation.configure_compiler.cache_clear()  # applied once per process: apply it again
    decode.compile_engine(model, "cpu", "whole")
    vector_cpu = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    assert inductor_config.cpp.vec_isa_ok is (True if vector_cpu else None)
    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", None)
    monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "1")
    compilation.configure_compiler.cache_clear()
    decode.compile_engine(model, "cpu", "whole")
    assert inductor_config.cpp.vec_isa_ok is None  # left to inductor, which reads the variable itself
