"""kernels.py: the CPU kernel choice changes how a product is computed, never what it computes: column-major
weights, oneDNN-packed copies where they measure faster (and never inside frozen whole graphs), state dicts and tied
weights unchanged."""
import gc
import itertools
import os
from pathlib import Path

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


@pytest.mark.parametrize("shape", ["gqa", "tied-llama3"])
def test_stored_layout_keeps_one_copy_of_the_weights_and_the_logits(shape):
    """use_stored_layout (the layout stored graphs read): where f32_linear multiplies, each linear holds pack_f32's
    blocks and no longer its weight (one copy in memory), a tied output's blocks are made from the embeddings,
    which stay; elsewhere weights are column-major. Logits equal the checkpoint layout's up to rounding; the
    layout is the same every time."""
    model, original = tiny_model(**SHAPES[shape]), tiny_model(**SHAPES[shape])
    kernels.use_stored_layout(model)
    native = kernels.native_f32_linear(original.output.weight)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if native:
        assert all(m.weight is None and m.blocks.shape[1:] == (m.in_features, kernels.F32_BLOCK) for m in linears)
        assert torch.equal(model.tok_embeddings.weight, original.tok_embeddings.weight)
    else:
        assert all(m.weight.stride() == (1, m.out_features) for m in linears)
    ids = tokens(20, batch=2)
    assert_close(full_forward(model, ids), full_forward(original, ids))
    again = tiny_model(**SHAPES[shape])
    kernels.use_stored_layout(again)
    layout = [(n, t.shape, t.stride()) for n, t in again.named_buffers() if "cache" not in n and "rope" not in n]
    assert layout == [(n, t.shape, t.stride()) for n, t in model.named_buffers() if "cache" not in n and "rope" not in n]


def file_mappings(path) -> dict:
    """{(start, end): resident bytes} of this process's private mappings of the file at `path` (/proc/self/smaps)."""
    found, current = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                ours = len(fields) == 6 and fields[5] == str(Path(path).resolve()) and fields[1].endswith("p")
                current = tuple(int(x, 16) for x in fields[0].split("-")) if ours else None
            elif current is not None and fields[0] == "Rss:":
                found[current] = int(fields[1]) * 1024
    return found


def resident_and_read(model, path) -> tuple:
    """(resident bytes of the model's own mapping of the file, bytes of the whole pages its tensors there span)."""
    page = os.sysconf("SC_PAGE_SIZE")
    storages = [t.untyped_storage() for t in itertools.chain(model.parameters(), model.buffers())]
    for (start, end), resident in file_mappings(path).items():
        inside = [s for s in storages if start <= s.data_ptr() < end]
        if inside:
            return resident, sum((-(-s.nbytes() // page) + 1) * page for s in inside)
    return 0, 0


def mapping_fields(address: int) -> dict:
    """The /proc/self/smaps fields of the mapping that holds `address` ({} where none does), with its "path"."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                if found is not None:
                    return found
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found = {"path": fields[5] if len(fields) == 6 else ""} if start <= address < end else None
            elif found is not None and fields[0].endswith(":"):
                found[fields[0][:-1]] = fields[1]
    return found or {}


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not kernels.huge_pages_available(),
                    reason="Linux with transparent huge pages")
@pytest.mark.parametrize("layout", ["use_stored_layout", "use_fast_weight_layout"])
@pytest.mark.parametrize("checkpoint", ["file", "tied-llama3"])
def test_weights_move_onto_huge_pages_unchanged(layout, checkpoint, random_target, monkeypatch):
    """After either layout every weight (parameters and buffers, not the KV caches) lies in one anonymous mapping
    advised for 2 MB pages (smaps' THPeligible), with the bytes, shapes and strides it had on 4 KB pages: the
    logits are equal exactly; a tied output still is the table; a checkpoint's file pages are all gone; a second
    call moves nothing."""
    import generation

    def build():
        model = generation.load_model(random_target) if checkpoint == "file" else tiny_model(**SHAPES[checkpoint])
        model.setup_caches(2, MAX_SEQ)
        model.register_buffer("a_view", model.norm.weight.detach()[3:13].view(2, 5), persistent=False)  # offset 3
        getattr(kernels, layout)(model)
        return model

    monkeypatch.setenv("FASTGEN_HUGE_PAGES", "1")
    gc.collect()  # an earlier test's model of the same file, in a reference cycle: its mapping goes now
    others = set(file_mappings(random_target))  # a model still alive elsewhere keeps its own
    model = build()
    if checkpoint == "file":
        assert sum(n for where, n in file_mappings(random_target).items() if where not in others) == 0
    monkeypatch.setenv("FASTGEN_HUGE_PAGES", "0")
    before = build()
    caches = {id(t) for m in model.modules() if hasattr(m, "k_cache") for t in m.buffers(recurse=False)}
    weights = [t for t in itertools.chain(model.parameters(), model.buffers()) if id(t) not in caches]
    arenas = {mapping_fields(t.data_ptr()).get("path", "?") for t in weights}
    assert arenas == {""}, arenas  # anonymous
    fields = mapping_fields(weights[0].data_ptr())
    assert fields["THPeligible"] == "1", fields
    assert all(mapping_fields(t.data_ptr()) == fields for t in weights)  # the same mapping
    for (name, a), (_, b) in zip(model.named_buffers(), before.named_buffers()):
        assert a.shape == b.shape and a.stride() == b.stride() and (id(a) in caches or torch.equal(a, b)), name
    for (name, a), (_, b) in zip(model.named_parameters(), before.named_parameters()):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b), name
    if model.args.tie_word_embeddings and model.output.weight is not None:
        assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert model.a_view.data_ptr() == model.norm.weight.data_ptr() + 3 * 4  # still a view of the norm's weight
    ids = tokens(20, batch=2)
    with torch.no_grad():
        assert torch.equal(model(ids, torch.arange(20).expand(2, -1)), before(ids, torch.arange(20).expand(2, -1)))
    where = [t.data_ptr() for t in weights]
    kernels.onto_huge_pages(model)
    assert [t.data_ptr() for t in weights] == where


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_a_memory_mapped_checkpoints_pages_go_once_its_weights_are_laid_out_anew(random_target, monkeypatch):
    """After use_stored_layout the file pages of a checkpoint loaded with mmap stay resident only where a tensor of
    the model still reads them (the embeddings, norms): weights packed or copied into a layout of their own leave
    none behind (without kernels.drop_pages they would), and /proc/self/maps is read a
    fixed number of times, not once per weight; and the model computes what it did before. On 4 KB pages: on huge
    pages every weight leaves the file (test_weights_move_onto_huge_pages_unchanged)."""
    import generation
    monkeypatch.setenv("FASTGEN_HUGE_PAGES", "0")
    ids, pos = tokens(12), torch.arange(12).view(1, -1)
    size = random_target.stat().st_size
    for release in (False, True):
        model = generation.load_model(random_target)
        with torch.no_grad():
            model.setup_caches(1, MAX_SEQ)
            full = model(ids, pos)
            for t in itertools.chain(model.parameters(), model.buffers()):
                t.sum()  # every page read, as packing them does
            assert resident_and_read(model, random_target)[0] >= 0.9 * size
            reads, read_maps = [], kernels.file_mappings
            with monkeypatch.context() as patch:
                patch.setattr(kernels, "file_mappings", lambda: reads.append(1) or read_maps())
                if not release:  # no page dropped: neither each weight's as it is laid out nor those left at the end
                    patch.setattr(kernels, "drop_pages", lambda ranges: None)
                kernels.use_stored_layout(model)
            resident, read = resident_and_read(model, random_target)
            if kernels.native_f32_linear(torch.zeros(2, 2)) or release:
                assert (resident <= read) == release, (resident, read, size)
            assert len(reads) <= 2
            torch.testing.assert_close(model(ids, pos), full, rtol=1e-5, atol=1e-5)


def test_buffers_are_parameters_on_the_same_memory_while_exported_only():
    """compilation.buffers_as_parameters: inside, the module has no buffers and each is a parameter of the same name
    on the same memory (AOTInductor copies buffers, not parameters); after, each is a buffer again, persistent or
    not as before, so the state dict and the stored graph's constant names are unchanged."""
    import compilation
    model = tiny_model(**SHAPES["gqa"])
    kernels.use_stored_layout(model)
    buffers = {n: (t.data_ptr(), t.shape) for n, t in model.named_buffers()}
    keys = list(model.state_dict())
    with compilation.buffers_as_parameters(model):
        assert not list(model.named_buffers())
        params = dict(model.named_parameters())
        assert all(not params[n].requires_grad and (params[n].data_ptr(), params[n].shape) == v
                   for n, v in buffers.items())
    assert {n: (t.data_ptr(), t.shape) for n, t in model.named_buffers()} == buffers
    assert list(model.state_dict()) == keys


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


# ----------------------------------------------------------------------------- int8 / int4 times 8-bit activations

def a8_isas():
    """Every path of kernels_a8.cpp this CPU runs, the forced portable one included."""
    if not kernels.a8_kernels():
        pytest.skip("kernels_a8.cpp does not build here")
    best = torch.ops.fastgen.a8_isa()
    return ["portable", "avx2", "avx512_vnni"][:["portable", "avx2", "avx512_vnni"].index(best) + 1]


@pytest.fixture(params=["portable", "avx2", "avx512_vnni"])
def isa(request, monkeypatch):
    if request.param not in a8_isas():
        pytest.skip(f"this CPU has no {request.param}")
    monkeypatch.setenv("FASTGEN_A8_ISA", request.param)
    assert torch.ops.fastgen.a8_isa() == request.param
    return request.param


def quantize_activations(x):
    """[M, K] float32 -> (q [M, K] float64 integers, d [M, K / 32 rounded up] float32): the documented rule,
    d = max|x| / 127 per block of 32 inputs, q = round-half-even(x / d), in float32 as the kernels compute it."""
    M, K = x.shape
    blocks = torch.nn.functional.pad(x, (0, -K % 32)).view(M, -1, 32)
    d = blocks.abs().amax(-1) / 127
    q = torch.where(d[..., None] == 0, 0.0, torch.round(blocks / d[..., None]))
    return q.view(M, -1)[:, :K].double(), d


def activations(M, K, seed=0):
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 1, K)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    x[-1, 3] = 300.0  # an outlier: its block's other inputs lose precision, the other blocks do not
    return x


def a8_linear(mode, N, K, groupsize=32, seed=1):
    """A packed Int8A8Linear / Int4A8Linear of random weights, and its float64 weights from the same integers."""
    import quantize
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-2, 0, N)[:, None]
    if mode == "int8":
        module = quantize.Int8A8Linear(K, N)
        module.weight, module.scales = quantize.quantize_int8(w)
        reference = quantize.dequantize_int8(module.weight, module.scales, torch.float64)
    else:
        module = quantize.Int4A8Linear(K, N, groupsize)
        module.weight, module.scales_and_zeros = quantize.quantize_int4(w, groupsize)
        reference = quantize.dequantize_int4(module.weight, module.scales_and_zeros, groupsize, torch.float64)
    module.pack_for_cpu()
    assert module.packed_for_cpu
    return module, reference


def assert_equals_reference(y, x, reference):
    """y = (q_x * d) @ W^T in float64 from the same integers, up to float32 rounding of the sums (a relative 1e-5 of
    the sum of the products' magnitudes; the integer dot products themselves are exact)."""
    q, d = quantize_activations(x)
    dequantized = q * d.double().repeat_interleave(32, dim=1)[:, :x.shape[1]]
    want = dequantized @ reference.t()
    bound = dequantized.abs() @ (reference.abs() + reference.abs().amax(1, keepdim=True)).t()
    error = (y.double() - want).abs()
    assert (error <= 1e-5 * bound + 1e-30).all(), (error / bound).max().item()


def test_a8_activations_are_quantized_by_the_documented_rule():
    if not kernels.a8_kernels():
        pytest.skip("kernels_a8.cpp does not build here")
    for K in (33, 64, 100, 576):
        x = activations(3, K)
        q, d = torch.ops.fastgen.a8_quantize(x, -(-K // 64) * 64)
        want_q, want_d = quantize_activations(x)
        assert torch.equal(q[:, :K].double(), want_q) and not q[:, K:].any()
        assert torch.equal(d[:, :want_d.shape[1]], want_d) and int(q.abs().max()) == 127


@pytest.mark.parametrize("M, N, K", [(1, 37, 576), (1, 5, 100), (6, 64, 1536), (9, 3, 33)])
def test_a8_int8_equals_float64_reference(isa, M, N, K):
    module, reference = a8_linear("int8", N, K)
    x = activations(M, K)
    y = module(x)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert_equals_reference(y, x, reference)


@pytest.mark.parametrize("groupsize, K", [(32, 96), (32, 576), (64, 576), (64, 1024), (128, 512), (256, 768)])
@pytest.mark.parametrize("M", [1, 6])
def test_a8_int4_equals_float64_reference(isa, groupsize, K, M):
    module, reference = a8_linear("int4", 21, K, groupsize)
    x = activations(M, K)
    assert_equals_reference(module(x), x, reference)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a8_rows_do_not_depend_on_the_rows_beside_them(isa, mode):
    """A token scores the same in a one-token decode, a batch or a verification: row by row = all rows at once,
    bit for bit (the kernels take activation rows four at a time)."""
    module, _ = a8_linear(mode, 19, 192)
    x = activations(11, 192).view(1, 11, 192)
    y = module(x)
    assert y.shape == (1, 11, 19)
    assert torch.equal(torch.cat([module(x[:, i:i + 1]) for i in range(11)], dim=1), y)
    assert module(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a8_non_finite_inputs_stay_visible(isa, mode):
    """A NaN or infinite input makes its own row's outputs NaN (generation checks its logits), not finite noise."""
    module, _ = a8_linear(mode, 8, 128)
    x = activations(3, 128)
    x[0, 70], x[2, 5] = float("nan"), float("inf")
    y = module(x)
    assert y[0].isnan().all() and y[2].isnan().all() and y[1].isfinite().all()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a8_threads_share_rows_not_sums(mode):
    """Products over 64 KiB of weights run on every thread, each taking whole rows: the same bits as one thread."""
    a8_isas()
    module, _ = a8_linear(mode, 1030, 256)
    x = activations(3, 256)
    one = module(x)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(module(x), one)
    finally:
        torch.set_num_threads(threads)


def test_a8_compiled_equals_eager():
    """torch.compile(fullgraph) traces the operators through their fake implementations and calls the same kernels
    (a8 and weight-only int8): the same bits as eager."""
    a8_isas()
    int8, _ = a8_linear("int8", 64, 96)
    int4, _ = a8_linear("int4", 40, 64, groupsize=32)
    import quantize
    plain = quantize.Int8Linear(40, 24)  # weight-only int8: fastgen::int8_linear
    plain.weight, plain.scales = quantize.quantize_int8(torch.randn(24, 40, generator=torch.Generator().manual_seed(2)))
    plain.pack_for_cpu()
    layers = torch.nn.Sequential(int8, torch.nn.SiLU(), int4, plain)
    x = activations(5, 96).view(1, 5, 96)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(layers, fullgraph=True)(x), layers(x))


def test_without_a_compiler_one_line_and_the_weight_only_kernels(monkeypatch, capsys):
    import quantize
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension 'fastgen_a8': c++: command not found\nmore")
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert kernels.a8_kernels.__wrapped__() is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot build kernels_a8.cpp" in err and "c++: command not found" in err
    monkeypatch.setattr(kernels, "a8_kernels", lambda: False)
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    plain, a8 = quantize.Int4Linear(64, 32, 32), quantize.Int4A8Linear(64, 32, 32)
    for module in (plain, a8):
        module.weight, module.scales_and_zeros = quantize.quantize_int4(w, 32)
        module.pack_for_cpu()
    x = torch.randn(2, 64)
    assert not a8.a8 and torch.equal(a8(x), plain(x))
    int8, int8_a8 = quantize.Int8Linear(64, 32), quantize.Int8A8Linear(64, 32)  # ATen's weight-only int8 kernel
    for module in (int8, int8_a8):
        module.weight, module.scales = quantize.quantize_int8(w)
        module.pack_for_cpu()
    want = torch.ops.aten._weight_int8pack_mm(x.bfloat16(), int8.weight, int8.scales).float()
    assert not int8.packed_for_cpu and torch.equal(int8(x), want) and torch.equal(int8_a8(x), want)


@pytest.mark.parametrize("M, N, K", [(1, 37, 576), (6, 5, 100), (17, 70, 1000)])
def test_int8_weights_times_float32_activations(isa, M, N, K):
    """The weight-only int8 scheme on the CPU (quantize.Int8Linear, packed): fastgen::int8_linear's x @ (q * s)^T
    in float32 equals the float64 product from the same integers up to float32 rounding of the sums."""
    import quantize
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 0, N)[:, None]
    module = quantize.Int8Linear(K, N)
    module.weight, module.scales = quantize.quantize_int8(w)
    reference = quantize.dequantize_int8(module.weight, module.scales, torch.float64)
    module.pack_for_cpu()
    assert module.packed_for_cpu and module.weight.shape[1] % quantize.A8_STEP == 0
    x = activations(M, K)
    y = module(x.view(1, M, K)).view(M, N)
    want = x.double() @ reference.t()
    assert ((y.double() - want).abs() <= 1e-5 * (x.double().abs() @ reference.abs().t())).all()
    assert torch.equal(module(x[-1:]), y[-1:])  # a row's result does not depend on the rows beside it


@pytest.mark.parametrize("M, N, K", [(1, 37, 576), (6, 64, 100), (7, 130, 33), (13, 5, 1000), (2, 200, 16)])
def test_f32_linear_equals_float64_reference(isa, M, N, K):
    """Stored graphs' float32 products (fastgen::f32_linear on kernels.pack_f32's blocks of 64 outputs): x @ W^T
    up to float32 rounding of the sums, for outputs and inputs that fill no block or vector, one row and more rows
    than one pass holds; a row's result is the same bits whatever rows are beside it (a verification's logits of a
    token are its decode step's), and the packing zero-fills past N."""
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=generator) * torch.logspace(-2, 0, N)[:, None]
    x = activations(M, K)
    packed = kernels.pack_f32(w)
    assert packed.shape == (-(-N // 64), K, 64) and not packed.transpose(1, 2).reshape(-1, K)[N:].any()
    y = torch.ops.fastgen.f32_linear(x, packed, N)
    want = x.double() @ w.double().t()
    assert ((y.double() - want).abs() <= 1e-5 * (x.double().abs() @ w.double().abs().t()) + 1e-30).all()
    for m in range(M):
        assert torch.equal(torch.ops.fastgen.f32_linear(x[m:m + 1].contiguous(), packed, N), y[m:m + 1])
    assert torch.equal(kernels.f32_linear(x.view(1, M, K), packed, N), y.view(1, M, N))


def test_f32_linear_is_chosen_for_stored_cpu_graphs_of_float32_only():
    a8_isas()
    w = torch.randn(4, 8)
    native = torch.ops.fastgen.a8_isa() == "avx512_vnni"
    assert kernels.native_f32_linear(w) == native
    assert not kernels.native_f32_linear(w.bfloat16())


# ----------------------------------------------------------------------------- attention over the KV cache

def attention_reference(q, k, v, mask):
    """float64 softmax attention, each query row g * T + t on mask row t; a row that sees no key: zeros."""
    B, H, R, D = q.shape
    T, S = mask.shape[2], mask.shape[3]
    rows = mask.expand(B, 1, T, S)[:, :, torch.arange(R) % T]  # [B, 1, R, S]
    scores = (q.double() @ k.double().transpose(-1, -2)) / D ** 0.5
    weights = torch.softmax(scores.masked_fill(~rows, float("-inf")), -1).nan_to_num(0.0)
    return (weights @ v.double()).float()


@pytest.mark.parametrize("B, H, G, T, S, D", [
    (1, 3, 9, 1, 256, 64),    # SmolLM2 decode
    (2, 6, 1, 1, 300, 64),    # multi-head, a batch
    (1, 2, 4, 5, 77, 128),    # a verification width, keys not a multiple of 16
    (3, 1, 3, 16, 40, 16),    # the widest of the own kernel
    (1, 2, 2, 17, 50, 32),    # wider: ATen's kernel
    (2, 2, 1, 3, 1000, 48),
    (1, 1, 20, 2, 33, 80),    # more than 16 query heads per kv head
    (1, 2, 3, 2, 40, 24)])    # a head size that is no multiple of 16: ATen's kernel
def test_attention_equals_float64_reference(isa, B, H, G, T, S, D):
    """fastgen::attention on random (tree-like) masks: the float64 softmax attention within float32 rounding, a
    token that sees no key giving zeros, and a mask shared by the batch (first dimension 1) broadcast."""
    g = torch.Generator().manual_seed(B * 1000 + S)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for n in (G * T, S, S))
    mask = torch.rand(B, 1, T, S, generator=g) < 0.6
    mask[..., S // 2:] &= torch.rand(B, 1, T, 1, generator=g) < 0.5  # some tokens see only the first half
    mask[-1, 0, -1] = False
    for m in (mask, mask[:1]):
        out = kernels.attention(q, k, v, m)
        assert out.shape == q.shape and out.is_contiguous()
        torch.testing.assert_close(out, attention_reference(q, k, v, m), rtol=1e-5, atol=2e-6)
        assert (out[-1, :, torch.arange(G) * T + T - 1] == 0).all() == (m.shape[0] == B)


@pytest.mark.parametrize("T", [1, 4, 24])
def test_attention_reads_no_key_past_the_last_allowed(isa, T):
    """A long cache mostly empty costs nothing: keys and values past the last slot any token may see are never read
    (NaN there changes nothing), with the own kernel (T <= 16) and ATen's alike."""
    g = torch.Generator().manual_seed(T)
    q = torch.randn(2, 3, 3 * T, 32, generator=g)
    k, v = torch.randn(2, 3, 512, 32, generator=g), torch.randn(2, 3, 512, 32, generator=g)
    filled = 40 + T
    mask = (torch.arange(512).view(1, 1, 1, -1) < torch.arange(40, 40 + T).view(1, 1, T, 1) + 1).expand(2, 1, T, 512)
    want = kernels.attention(q, k[:, :, :filled].contiguous(), v[:, :, :filled].contiguous(),
                             mask[..., :filled].contiguous())
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    got = kernels.attention(q, k, v, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def decode_step_mask(B, T, S, idle):
    """A server's decode step: idle rows see only the scratch slot (the cache's last), the others every slot up to
    their position (rows b at 40 + 100 b, T tokens each)."""
    slots = torch.arange(S).view(1, 1, 1, -1)
    mask = slots <= (torch.arange(B) * 100 + 40).view(B, 1, 1, 1) + torch.arange(T).view(1, 1, T, 1)
    mask[idle] = (slots == S - 1).expand(1, 1, T, S)
    return mask


@pytest.mark.parametrize("T", [1, 3, 24])
def test_attention_of_rows_that_see_only_the_last_slot(isa, T):
    """Idle rows of a decode step beside decoding ones: the float64 reference on every path, each idle row's output
    the last slot's value (the softmax of one key)."""
    g = torch.Generator().manual_seed(T)
    B, H, G, S, D = 4, 2, 3, 300, 32
    q = torch.randn(B, H, G * T, D, generator=g)
    k, v = torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    idle = torch.tensor([False, True, False, True])
    mask = decode_step_mask(B, T, S, idle)
    out = kernels.attention(q, k, v, mask)
    torch.testing.assert_close(out, attention_reference(q, k, v, mask), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out[idle], v[idle][:, :, -1:].expand(-1, -1, G * T, -1))


# a child process: the keys and values in a page-aligned buffer, the pages an idle row's mask hides made unreadable
# (mprotect): a read of any of them is a segmentation fault, so a clean exit means the kernel never touched them
NO_READ_BEFORE_FIRST = """
import ctypes, mmap, sys
import torch
sys.path.insert(0, sys.argv[1])
import kernels, test_kernels
assert kernels.a8_kernels()
B, H, G, S, D = 4, 2, 3, 256, 32  # a (row, head) of the cache: 32 KiB, whole pages
idle = torch.tensor([False, True, False, True])
buffer = mmap.mmap(-1, 2 * B * H * S * D * 4)
cache = torch.frombuffer(buffer, dtype=torch.float32).view(2, B, H, S, D)
cache.copy_(torch.randn(2, B, H, S, D))
k, v = cache
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
for T in (1, 3, 16):
    q = torch.randn(B, H, G * T, D)
    mask = test_kernels.decode_step_mask(B, T, S, idle)
    want = kernels.attention(q, k.clone(), v.clone(), mask)
    hidden = (S - 1) * D * 4 // mmap.PAGESIZE * mmap.PAGESIZE  # the slots before the last, whole pages
    for t in (k, v):
        for b in idle.nonzero().view(-1).tolist():
            for h in range(H):
                assert libc.mprotect(t[b, h].data_ptr(), hidden, 0) == 0  # PROT_NONE
    assert torch.equal(kernels.attention(q, k, v, mask), want)
    for t in (k, v):
        for b in idle.nonzero().view(-1).tolist():
            for h in range(H):
                assert libc.mprotect(t[b, h].data_ptr(), hidden, mmap.PROT_READ | mmap.PROT_WRITE) == 0
print("ok")
"""


@pytest.mark.slow  # a child process per ISA
def test_attention_reads_no_key_before_the_first_allowed(isa):
    """The own kernel (a few tokens, AVX2 / AVX-512) reads a row's keys and values from the first its mask allows:
    an idle row of a decode step, which sees only the last slot, costs one key, not the whole cache (ATen's kernel,
    the portable path, reads from the first slot)."""
    import subprocess
    import sys
    if isa == "portable" or not sys.platform.startswith("linux"):
        pytest.skip("ATen's kernel reads every slot up to the last allowed; mprotect: Linux")
    done = subprocess.run([sys.executable, "-c", NO_READ_BEFORE_FIRST, str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_attention_compiled_equals_eager():
    a8_isas()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 3, 9, 64, generator=g), torch.randn(1, 3, 100, 64, generator=g), \
        torch.randn(1, 3, 100, 64, generator=g)
    mask = torch.arange(100).view(1, 1, 1, -1) <= 70
    torch._dynamo.reset()
    assert torch.equal(torch.compile(kernels.attention, fullgraph=True)(q, k, v, mask),
                       kernels.attention(q, k, v, mask))


def test_attention_without_the_kernels_is_sdpa_on_the_repeated_mask(monkeypatch):
    monkeypatch.setattr(kernels, "a8_kernels", lambda: False)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 2, 6, 16, generator=g), torch.randn(2, 2, 20, 16, generator=g), \
        torch.randn(2, 2, 20, 16, generator=g)
    mask = torch.rand(2, 1, 2, 20, generator=g) < 0.7
    mask[..., 0] = True
    repeated = mask[:, :, torch.arange(6) % 2]
    assert torch.equal(kernels.attention(q, k, v, mask),
                       torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=repeated))


def test_two_checkouts_of_the_kernels_build_apart_and_one_source_builds_once(tmp_path):
    """The build directory follows the source's text, torch's version and the source's path: two checkouts of the
    same file would otherwise share one directory whose build file names the other's path, and rebuild it in turn."""
    a, b = tmp_path / "a" / "kernels_a8.cpp", tmp_path / "b" / "kernels_a8.cpp"
    for path in (a, b):
        path.parent.mkdir()
        path.write_bytes(kernels.A8_SOURCE.read_bytes())
    assert kernels.build_directory(a) != kernels.build_directory(b)
    assert kernels.build_directory(a) == kernels.build_directory(tmp_path / "a" / ".." / "a" / "kernels_a8.cpp")
    before = kernels.build_directory(a)
    a.write_bytes(a.read_bytes() + b"\n")  # an edited source builds anew
    assert kernels.build_directory(a) != before
    assert kernels.build_directory(kernels.A8_SOURCE).name.startswith("fastgen_a8_")
