"""quantize.py: error bounds, logits and held-out perplexity close to full precision, generate.py loading
quantized targets and drafts (eager, compiled, speculative), clear errors, tensor-parallel slicing."""
import copy
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import generation
import quantize
import tp
from helpers import ROOT, write_checkpoint
from errors import UserError
from helpers import cli
from model import ModelArgs


def sample_weight(n=48, k=256):
    """A weight with rows and groups of very different ranges, an outlier and an all-zero row."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 0, n)[:, None]
    w[5, 17] = 40.0
    w[7] = 0.0
    return w


def dequantized(module) -> torch.Tensor:
    if isinstance(module, quantize.Int8Linear):
        return quantize.dequantize_int8(module.weight, module.scales)
    return quantize.dequantize_int4(module.weight, module.scales_and_zeros, module.groupsize)


def quantized_linear(w, mode, groupsize=32, pack=True):
    n, k = w.shape
    if mode == "int8":
        module = quantize.Int8Linear(k, n)
        module.weight, module.scales = quantize.quantize_int8(w)
    else:
        module = quantize.Int4Linear(k, n, groupsize)
        module.weight, module.scales_and_zeros = quantize.quantize_int4(w, groupsize)
        if pack:
            module.pack_for_cpu()
    return module


# ----------------------------------------------------------------------------- quantize -> dequantize

def test_int8_error_at_most_half_a_step():
    w = sample_weight()
    q, scales = quantize.quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scales.shape == (w.shape[0],)
    assert int(q.abs().max()) <= 127
    error = (w - quantize.dequantize_int8(q, scales)).abs()
    step = scales.float()[:, None]
    assert (error <= step / 2 * (1 + 1e-6)).all()
    # the step is the row's largest |w| / 127, not something coarser that would also pass the bound
    torch.testing.assert_close(step[:, 0], (w.abs().amax(1) / 127).clamp(min=quantize.MIN_SCALE), rtol=2 ** -8, atol=0)
    assert torch.equal(quantize.dequantize_int8(q, scales)[7], torch.zeros(w.shape[1]))  # all-zero row stays zero


@pytest.mark.parametrize("groupsize", quantize.GROUPSIZES)
def test_int4_error_at_most_half_a_group_step(groupsize):
    w = sample_weight()
    packed, scales_and_zeros = quantize.quantize_int4(w, groupsize)
    n, k = w.shape
    assert packed.dtype == torch.uint8 and packed.shape == (n, k // 2)
    assert scales_and_zeros.shape == (k // groupsize, n, 2)
    error = (w - quantize.dequantize_int4(packed, scales_and_zeros, groupsize)).abs()
    step = scales_and_zeros[..., 0].float().t().repeat_interleave(groupsize, dim=1)  # [n, k]
    assert (error <= step / 2 * (1 + 1e-5) + 1e-7).all()
    groups = w.view(n, k // groupsize, groupsize)
    group_range = (groups.amax(-1) - groups.amin(-1)).t()  # 16 levels span each group's range
    torch.testing.assert_close(scales_and_zeros[..., 0].float(), (group_range / 15).clamp(min=quantize.MIN_SCALE),
                               rtol=2 ** -8, atol=0)


def test_int4_packing_order():
    """Two values a byte, column 2i in the low 4 bits: the documented file layout."""
    q = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    assert packed.tolist() == [[0x21, 0x43]]
    assert torch.equal(quantize.unpack_int4(packed), q)


@pytest.mark.parametrize("mode", ["int8", "int4-kernel", "int4-dequantize"])
def test_quantized_linear_computes_x_times_dequantized_weight(mode):
    w = sample_weight(n=64)
    module = quantized_linear(w, mode[:4], pack=mode != "int4-dequantize")
    if mode.startswith("int4"):
        assert module.packed_for_cpu == (mode == "int4-kernel")
    reference_weight = dequantized(quantized_linear(w, mode[:4], pack=False))
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, w.shape[1], generator=generator).to(dtype)
        y = module(x)
        assert y.dtype == dtype and y.shape == (3, 5, w.shape[0])
        want = x.float() @ reference_weight.t()
        # the CPU kernels run on bf16 activations: relative error ~2^-8 per row
        assert ((y.float() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-2
        if mode == "int4-dequantize":
            continue  # fp32 F.linear: the fallback off the CPU kernels, not held to bit equality
        # each row's result does not depend on the other rows (batch, prefill or verification width),
        # so a speculative verification scores a token exactly as a one-token decode does
        assert torch.equal(torch.cat([module(x[i:i + 1, j:j + 1]) for i in range(3) for j in range(5)]).view_as(y), y)


def test_off_cpu_path_keeps_the_activation_dtype():
    """Off the CPU the modules dequantize in the activation's dtype (no GPU here: the meta device checks
    shapes and dtypes of that path, e.g. bf16 scales meeting fp16 or fp32 activations)."""
    w = sample_weight(n=64)
    for mode in ("int8", "int4"):
        module = quantized_linear(w, mode, pack=False).to("meta")
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            y = module(torch.empty(2, 3, w.shape[1], dtype=dtype, device="meta"))
            assert y.shape == (2, 3, 64) and y.dtype == dtype


# ----------------------------------------------------------------------------- whole models

def quantized_file(checkpoint, mode, groupsize=None):
    path = quantize.output_path(checkpoint, {"mode": mode, "groupsize": groupsize})
    if not path.is_file():
        assert quantize.quantize_checkpoint(checkpoint, mode, groupsize) == path
    return path


def logits(model, x):
    model.setup_caches(x.shape[0], x.shape[1])
    with torch.no_grad():
        return model(x, torch.arange(x.shape[1]).repeat(x.shape[0], 1)).float()


def private_copy(directory, tmp_path_factory):
    """The quantized files go beside the checkpoint: write them into a copy, not the shared fixtures."""
    destination = tmp_path_factory.mktemp(directory.name)
    shutil.copytree(directory, destination, dirs_exist_ok=True)
    return destination


@pytest.fixture(scope="module")
def target(random_target, tmp_path_factory):
    return private_copy(random_target.parent, tmp_path_factory) / "model.pth"


@pytest.fixture(scope="module")
def draft(random_draft, tmp_path_factory):
    return private_copy(random_draft.parent, tmp_path_factory) / "model.pth"


@pytest.fixture(scope="module")
def pair(trained_pair, tmp_path_factory):
    return private_copy(trained_pair, tmp_path_factory)


@pytest.fixture(scope="module")
def tied_target(tmp_path_factory, tokenizer_model):
    """Tied embeddings, stored without output.weight (the loader then reuses tok_embeddings.weight)."""
    path = write_checkpoint(tmp_path_factory.mktemp("tied"), tokenizer_model, seed=3, dim=64, n_layer=2, n_head=4,
                            n_local_heads=2, vocab_size=512, block_size=256, tie_word_embeddings=True)
    state_dict = torch.load(path, weights_only=True)
    del state_dict["output.weight"]
    torch.save(state_dict, path)
    return path


@pytest.fixture(scope="module")
def tied_target_with_output(tmp_path_factory, tokenizer_model):
    """Tied embeddings with output.weight written beside the table, as convert_hf_checkpoint.py writes them."""
    return write_checkpoint(tmp_path_factory.mktemp("tied_output"), tokenizer_model, seed=3, dim=64, n_layer=2,
                            n_head=4, n_local_heads=2, vocab_size=512, block_size=256, tie_word_embeddings=True)


@pytest.mark.parametrize("mode, groupsize, bound", [("int8", None, 0.015), ("int4", 32, 0.06)])
@pytest.mark.parametrize("which", ["untied", "tied", "bf16"])
def test_logits_close_to_full_precision(mode, groupsize, bound, which, target, tied_target):
    """Random tiny model, 2 x 24 tokens: ||logits - fp32 logits|| / ||fp32 logits|| under `bound`."""
    checkpoint = tied_target if which == "tied" else target
    precision = torch.bfloat16 if which == "bf16" else torch.float32
    reference = generation.load_model(checkpoint)
    model = generation.load_model(quantized_file(checkpoint, mode, groupsize), precision=precision)
    assert model.quantization == {"mode": mode, **({"groupsize": groupsize} if groupsize else {}), "embedding": "int8"}
    w13 = model.layers[0].feed_forward.w13  # w1 and w3 stacked at load time
    assert type(w13) is (quantize.Int8Linear if mode == "int8" else quantize.Int4Linear)
    if mode == "int4":
        assert w13.packed_for_cpu  # load_model put it in the CPU kernel's layout (the fast path)
    assert type(model.output) is quantize.Int8Linear  # the output layer is int8 in both modes
    assert model.model_bytes() < 0.5 * reference.model_bytes()
    table, scales = quantize.quantize_int8(reference.tok_embeddings.weight)  # the table: int8 rows, as a linear's
    assert torch.equal(model.tok_embeddings.weight, table) and torch.equal(model.tok_embeddings.scales, scales)
    if which == "tied":  # the output layer is the table's own rows (stored once), in its kernel's layout
        assert torch.equal(model.output.weight[:, :table.shape[1]], table)
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    want, got = logits(reference, x), logits(model, x)
    error = ((got - want).norm() / want.norm()).item()
    assert error < bound, error


@pytest.mark.parametrize("written", [False, True], ids=["table only", "output written too"])
@pytest.mark.parametrize("mode, groupsize", [("int8", None), ("int4", 32)])
def test_the_embedding_table_is_int8_and_a_tied_one_is_stored_once(mode, groupsize, written, tied_target,
                                                                   tied_target_with_output, tmp_path):
    """The file holds the embedding table as int8 rows with a scale each (a quarter of its float32 bytes); a tied
    output layer is not written again, whether or not the checkpoint held it beside the table; a row looks up
    exactly its dequantized values. A file written before the table was quantized (no "embedding" in its scheme)
    still loads, with its float table."""
    if written:
        assert "output.weight" in torch.load(tied_target_with_output, weights_only=True)
        tied_target = tied_target_with_output
    path = quantized_file(tied_target, mode, groupsize)
    saved = torch.load(path, weights_only=True)
    assert saved["quantization"]["embedding"] == "int8"
    assert saved["model"]["tok_embeddings.weight"].dtype == torch.int8
    assert not any(name.startswith("output.") for name in saved["model"])
    reference = generation.load_model(tied_target)
    table, scales = quantize.quantize_int8(reference.tok_embeddings.weight)
    idx = torch.tensor([[0, 7, 511, 7]])
    model = generation.load_model(path)
    assert torch.equal(model.tok_embeddings(idx), quantize.dequantize_int8(table, scales)[idx])
    args = ModelArgs.from_checkpoint_dir(tied_target.parent)
    scheme = {"mode": mode, **({"groupsize": groupsize} if groupsize else {})}
    old = tmp_path / "old" / "model_old.pth"
    shutil.copytree(tied_target.parent, old.parent)
    state_dict = torch.load(tied_target, weights_only=True)
    torch.save({"quantization": scheme, "model": quantize.quantize_state_dict(state_dict, args, scheme)}, old)
    assert old.stat().st_size > path.stat().st_size
    loaded = generation.load_model(old)
    assert type(loaded.tok_embeddings) is torch.nn.Embedding
    assert torch.equal(loaded.tok_embeddings.weight, reference.tok_embeddings.weight)


def heldout_ids(pair, n_tokens=2048):
    import sentencepiece
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(pair / "target" / "tokenizer.model"))
    ids = []
    for path in (pair / "heldout_files.txt").read_text().split():
        ids += [1, *tokenizer.encode(open(path, encoding="utf-8").read()), 2]
    assert len(ids) > n_tokens
    return torch.tensor(ids[:n_tokens + 1])


def perplexity(model, ids, window=128) -> float:
    n = (len(ids) - 1) // window
    x, y = ids[:n * window].view(n, window), ids[1:n * window + 1].view(n, window)
    return math.exp(F.cross_entropy(logits(model, x).flatten(0, 1), y.flatten()).item())


def test_heldout_perplexity_barely_moves(pair):
    """The trained tiny target on 2048 held-out tokens: int8 within 2%, int4 (groupsize 32) within 10%."""
    ids = heldout_ids(pair)
    checkpoint = pair / "target" / "model.pth"
    base = perplexity(generation.load_model(checkpoint), ids)
    assert base < 0.5 * 512  # the model learned something a broken quantizer could destroy
    for mode, groupsize, rise in (("int8", None, 0.02), ("int4", 32, 0.10)):
        ppl = perplexity(generation.load_model(quantized_file(checkpoint, mode, groupsize)), ids)
        assert ppl < base * (1 + rise), (mode, ppl, base)


# ----------------------------------------------------------------------------- generate.py

def run(checkpoint, *extra, n=16):
    return cli.main(["--checkpoint_path", str(checkpoint), "--prompt", "def main(", "--max_new_tokens", str(n),
                          "--num_samples", "1", "--temperature", "0", "--ignore_eos", *map(str, extra)])


def greedy_without_cache(model, prompt_ids, n):
    """Greedy decoding by full forwards over the growing sequence: the KV cache plays no part."""
    ids = list(prompt_ids)
    model.setup_caches(1, len(ids) + n)
    for _ in range(n):
        ids.append(int(logits(model, torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("mode, groupsize", [("int8", None), ("int4", 32), ("int8-a8", None), ("int4-a8", 32)])
def test_stacking_gate_and_up_changes_no_bit(mode, groupsize, target, monkeypatch):
    """load_model stacks each block's w1 and w3 into one product (quantize.fuse_gate_up): the logits are the bits
    of the separate products, for one row and for several."""
    path = quantized_file(target, mode, groupsize)
    fused = generation.load_model(path)
    for block in fused.layers:
        ffn = block.feed_forward
        assert not hasattr(ffn, "w1") and not hasattr(ffn, "w3")
        assert ffn.w13.out_features == 2 * ffn.w2.in_features
    monkeypatch.setattr(quantize, "fuse_gate_up", lambda model, empty=False: None)
    separate = generation.load_model(path)
    assert separate.layers[0].feed_forward.w13 is None
    for shape in [(1, 1), (3, 7)]:
        x = torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(1))
        assert torch.equal(logits(fused, x), logits(separate, x))


@pytest.mark.parametrize("mode, groupsize", [("int8", None), ("int4", 32)])
def test_generate_loads_quantized_checkpoint_by_path(mode, groupsize, target, tmp_path, capsys):
    path = quantized_file(target, mode, groupsize)
    stats_path = tmp_path / "stats.json"
    stats = run(path, "--stats_json", stats_path)
    assert json.loads(stats_path.read_text())["quantization"] == stats["quantization"] == mode
    assert f"(quantization: {mode})" in capsys.readouterr().out
    model = generation.load_model(path)
    assert stats["samples"][0]["tokens"] == greedy_without_cache(model, stats["prompt_tokens"], 16)
    batched = run(path, "--batch_size", 3, n=8)["samples"][0]["batch_tokens"]
    assert batched == [stats["samples"][0]["tokens"][:8]] * 3


@pytest.mark.parametrize("mode, groupsize", [pytest.param("int8", None, marks=pytest.mark.slow), ("int4", 32)])
def test_compiled_quantized_equals_eager(mode, groupsize, target):
    path = quantized_file(target, mode, groupsize)
    eager = run(path, n=8)
    compiled = run(path, "--compile", "whole", n=8)
    assert compiled["compile"] is True and compiled["quantization"] == mode
    assert compiled["samples"][0]["tokens"] == eager["samples"][0]["tokens"]


@pytest.mark.parametrize("mode, groupsize", [("int8-a8", None), ("int4-a8", 32)])
def test_a8_schemes_load_generate_and_compile(mode, groupsize, target, tmp_path):
    """The a8 schemes: recorded in the file, loaded into the integer kernels' layout, logits near fp32, greedy
    tokens equal full forwards without the cache (each row's result independent of the rows beside it), compiled
    regions and whole graphs generate the eager tokens, and as a draft they leave the target's tokens exact."""
    import kernels
    path = quantized_file(target, mode, groupsize)
    assert path.name == ("model_int8-a8.pth" if mode == "int8-a8" else "model_int4-a8.g32.pth")
    assert torch.load(path, weights_only=True)["quantization"] == {"mode": mode, **({"groupsize": 32} if groupsize
                                                                                   else {}), "embedding": "int8"}
    model = generation.load_model(path)
    w13, output = model.layers[0].feed_forward.w13, model.output
    assert type(w13) is (quantize.Int8A8Linear if mode == "int8-a8" else quantize.Int4A8Linear)
    assert type(output) is quantize.Int8A8Linear  # the output layer is int8 in both modes
    assert w13.packed_for_cpu == output.packed_for_cpu == kernels.a8_kernels()
    x = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    want, got = logits(generation.load_model(target), x), logits(model, x)
    assert ((got - want).norm() / want.norm()).item() < (0.03 if mode == "int8-a8" else 0.07)
    eager = run(path, "--stats_json", tmp_path / "stats.json", n=12)
    assert json.loads((tmp_path / "stats.json").read_text())["quantization"] == mode
    assert eager["samples"][0]["tokens"] == greedy_without_cache(model, eager["prompt_tokens"], 12)
    for compile_mode in ("regional", "whole"):
        assert run(path, "--compile", compile_mode, n=12)["samples"][0]["tokens"] == eager["samples"][0]["tokens"]
    # as the draft of its own full-precision model: the target's greedy tokens exactly
    speculative = run(target, "--speculate_k", 3, "--draft_checkpoint_path", path, n=12)
    assert speculative["speculative"] == "draft"
    assert speculative["samples"][0]["tokens"] == run(target, n=12)["samples"][0]["tokens"]


def test_greedy_speculative_with_int8_draft_or_target_equals_plain_greedy(pair):
    target, draft = pair / "target" / "model.pth", pair / "draft" / "model.pth"
    target_int8, draft_int8 = quantized_file(target, "int8"), quantized_file(draft, "int8")
    speculative = ["--speculate_k", 4, "--draft_checkpoint_path"]
    plain = run(target, n=32)["samples"][0]["tokens"]
    fp_draft = run(target, *speculative, draft, n=32)
    int8_draft = run(target, *speculative, draft_int8, n=32)
    assert int8_draft["speculative"] == "draft" and int8_draft["samples"][0]["tokens"] == plain
    # and the int8 draft still drafts what the target would say about as often as the full-precision one
    assert int8_draft["mean_accepted"] >= 0.8 * fp_draft["mean_accepted"] > 0
    plain_int8 = run(target_int8, n=32)["samples"][0]["tokens"]
    for draft_path in (draft, draft_int8):
        assert run(target_int8, *speculative, draft_path, n=32)["samples"][0]["tokens"] == plain_int8


# ----------------------------------------------------------------------------- errors

def test_clear_errors(target, draft, tmp_path):
    with pytest.raises(UserError, match="checkpoint not found"):
        quantize.quantize_checkpoint(tmp_path / "missing" / "model.pth", "int8")
    # the draft's layers take 32 inputs: a group of 64 cannot fit, and the message names the group size that does
    with pytest.raises(UserError, match=r"--groupsize 64 does not divide .* 32: use --groupsize 32"):
        quantize.quantize_checkpoint(draft, "int4", 64)
    with pytest.raises(UserError, match="--groupsize is for --mode int4"):
        quantize.quantize_checkpoint(target, "int8", 32)
    int8 = quantized_file(target, "int8")
    with pytest.raises(UserError, match=r"already quantized \(int8\)"):
        quantize.quantize_checkpoint(int8, "int4", 32)
    # a file whose scheme this code does not know is refused on load, not misread
    odd = tmp_path / "odd" / "model.pth"
    odd.parent.mkdir()
    (odd.parent / "config.json").write_bytes((target.parent / "config.json").read_bytes())
    torch.save({"quantization": {"mode": "int3"}, "model": {}}, odd)
    with pytest.raises(UserError, match="unknown quantization mode 'int3'"):
        generation.load_model(odd)
    assert not list(target.parent.glob(".*.tmp"))  # written atomically: no temporary file left


@pytest.mark.slow
def test_cli_writes_the_file_and_errors_are_one_line(draft):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ok = subprocess.run([sys.executable, "quantize.py", "--checkpoint_path", str(draft), "--mode", "int4",
                         "--groupsize", "32"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    written = draft.with_name("model_int4.g32.pth")
    assert str(written) in ok.stdout
    assert torch.load(written, weights_only=True)["quantization"] == {"mode": "int4", "groupsize": 32,
                                                                      "embedding": "int8"}
    bad = subprocess.run([sys.executable, "quantize.py", "--checkpoint_path", str(written), "--mode", "int8"],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("error: ") and "already quantized (int4)" in bad.stderr


# ----------------------------------------------------------------------------- tensor parallelism

@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_sharded_linears_add_up_to_the_unsharded_one(mode):
    """What tp.py does to each rank's copy, checked without torch.distributed: row-parallel partial outputs
    sum to the full output, column-parallel outputs side by side are the full output. Shards are cut from
    the loaded (portable) weights and then packed for the CPU kernel, as generation.load_model does."""
    w = sample_weight(n=128, k=256)
    unpacked = quantized_linear(w, mode, pack=False)
    full = quantize_pack(copy.deepcopy(unpacked))
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(0))
    want = full(x)

    partial = []
    for rank in range(2):
        shard = copy.deepcopy(unpacked)
        tp.keep_columns(shard, rank, 2)
        assert shard.in_features == 128
        partial.append(quantize_pack(shard)(x[..., rank * 128:(rank + 1) * 128]))
    # each half runs through the bf16 kernel on its own: equal up to bf16 rounding of the two halves
    torch.testing.assert_close(partial[0] + partial[1], want, rtol=0, atol=2e-2 * want.abs().max().item())

    # column-parallel with a [q; k; v]-style gather of row ranges, as tp.apply_tp does for wqkv
    rows = [torch.cat([torch.arange(0, 32), torch.arange(64, 80), torch.arange(96, 112)]),
            torch.cat([torch.arange(32, 64), torch.arange(80, 96), torch.arange(112, 128)])]
    outs = []
    for rank in range(2):
        shard = copy.deepcopy(unpacked)
        tp.keep_rows(shard, rows[rank])
        assert shard.out_features == 64
        outs.append(quantize_pack(shard)(x))
    order = torch.cat(rows)
    torch.testing.assert_close(torch.cat(outs, dim=-1), want[..., order], rtol=0, atol=0)


def quantize_pack(module):
    quantize.pack_for_device(module)
    return module


def test_int4_shard_must_hold_whole_groups():
    module = quantized_linear(sample_weight(n=32, k=64), "int4", groupsize=64, pack=False)
    with pytest.raises(UserError, match="group size 64 does not divide the 32 inputs"):
        tp.keep_columns(module, 0, 2)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_quantizing_lets_go_of_each_weights_file_pages(random_target):
    """quantize_state_dict reads each weight of the memory-mapped checkpoint once: its file pages do not stay in the
    process beside the quantized copy (an 8B model's would not fit beside it in memory)."""
    from errors import read_checkpoint
    from test_kernels import file_mappings
    state_dict = read_checkpoint(random_target)
    args = ModelArgs.from_checkpoint_dir(random_target.parent)
    for t in state_dict.values():
        t.sum()  # every page read, as quantizing does
    pointer = state_dict["norm.weight"].untyped_storage().data_ptr()

    def resident() -> int:  # of this state dict's own mapping of the file (other tests may map it too)
        return next(rss for (a, b), rss in file_mappings(random_target).items() if a <= pointer < b)
    before = resident()
    assert before >= 0.9 * random_target.stat().st_size
    quantized = quantize.quantize_state_dict(state_dict, args, {"mode": "int8", "embedding": "int8"})
    kept = [name for name in state_dict if quantized[name] is state_dict[name]]  # norms: still the file's
    assert kept and all("norm" in name for name in kept)
    after = resident()
    assert after <= sum(state_dict[name].nbytes for name in kept) + 4 * len(kept) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_packing_lets_go_of_each_weights_file_pages_as_it_packs(tmp_path, tokenizer_model, monkeypatch):
    """pack_for_device drops the file pages of each weight of the memory-mapped checkpoint right after stacking or
    packing it (its pages and all the new copies are never in memory at once), and reads this process's mappings a few
    times, not once per weight (hundreds of reads for an 8B model)."""
    import itertools
    import kernels
    from test_kernels import file_mappings
    path = quantized_file(write_checkpoint(tmp_path, tokenizer_model, dim=256, n_layer=3, n_head=4, n_local_heads=2,
                                           vocab_size=512, block_size=64), "int8")
    with monkeypatch.context() as patch:
        patch.setattr(quantize, "pack_for_device", lambda model: None)
        model = generation.load_model(path)
    for t in itertools.chain(model.parameters(), model.buffers()):
        t.sum()  # every page read, as packing them does
    pointer = model.norm.weight.untyped_storage().data_ptr()
    mapping = next((a, b) for a, b in file_mappings(path) if a <= pointer < b)
    seen, reads, pack, read_maps = [], [], quantize.Int8Linear.pack_for_cpu, kernels.file_mappings

    def packing(module):  # the file's resident bytes before each weight is packed, and the weight's if the file's
        in_file = mapping[0] <= module.weight.data_ptr() < mapping[1]
        seen.append((file_mappings(path)[mapping], module.weight.nbytes if in_file else 0))
        pack(module)
    stacks, stack = [], quantize.Int8Linear.stacked

    def stacking(module, other, empty=False):  # likewise before each w1 and w3 are stacked
        stacks.append((file_mappings(path)[mapping], module.weight.nbytes + other.weight.nbytes))
        return stack(module, other, empty)
    monkeypatch.setattr(quantize.Int8Linear, "pack_for_cpu", packing)
    monkeypatch.setattr(quantize.Int8Linear, "stacked", stacking)
    monkeypatch.setattr(kernels, "file_mappings", lambda: reads.append(1) or read_maps())
    quantize.pack_for_device(model)
    page = os.sysconf("SC_PAGE_SIZE")
    assert len(stacks) == 3
    for k, (resident, _) in enumerate(stacks):  # each pair's pages went as it was stacked
        assert resident <= stacks[0][0] - sum(n for _, n in stacks[:k]) + 4 * k * page, k
    assert len(seen) == 3 * 4 + 1 and sum(n for _, n in seen) > 0.5 * seen[0][0]
    for k, (resident, _) in enumerate(seen):
        assert resident <= seen[0][0] - sum(n for _, n in seen[:k]) + 4 * k * page, k
    assert len(reads) <= 3


# ----------------------------------------------------------------------------- the packed copy beside the checkpoint

def packed_copies(path):
    return sorted((path.parent / "compiled").glob(f"{path.stem}-packed-*.pth"))


def fresh_quantized(random_target, tmp_path, mode, groupsize):
    """A quantized file of its own (its packed copy and compiled/ are this test's)."""
    shutil.copytree(random_target.parent, tmp_path / "checkpoint")
    return quantized_file(tmp_path / "checkpoint" / "model.pth", mode, groupsize)


def packed_at_load(path, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(quantize, "load_packed", lambda *args: False)
        patch.setattr(quantize, "store_packed", lambda *args: None)
        return generation.load_model(path)


def load_counting_packs(path, monkeypatch):
    """(the model, how many times it was packed here rather than read from the packed copy)."""
    packs, pack = [], quantize.pack_for_device
    with monkeypatch.context() as patch:
        patch.setattr(quantize, "pack_for_device", lambda model: packs.append(1) or pack(model))
        return generation.load_model(path), len(packs)


def same_logits(a, b) -> bool:
    xs = [torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(1)) for shape in [(1, 1), (3, 7)]]
    return all(torch.equal(logits(a, x), logits(b, x)) for x in xs)


@pytest.mark.parametrize("mode, groupsize", [("int8", None), ("int4", 32), ("int8-a8", None), ("int4-a8", 32),
                                             ("int4-a8", 64)])
def test_packed_copy_gives_the_logits_of_packing_at_load(mode, groupsize, random_target, tmp_path, monkeypatch):
    """The first load packs and stores the packed copy in compiled/; the next reads it instead of packing, and
    its logits are the bits of packing at load."""
    path = fresh_quantized(random_target, tmp_path, mode, groupsize)
    first, packs = load_counting_packs(path, monkeypatch)
    assert packs == 1 and len(packed_copies(path)) == 1
    stored, packs = load_counting_packs(path, monkeypatch)
    assert packs == 0
    reference = packed_at_load(path, monkeypatch)
    assert same_logits(stored, reference) and same_logits(first, reference)


def test_changed_weights_file_refuses_the_packed_copy(random_target, tmp_path, monkeypatch):
    """Other weights under the same file name: the copy is stale (compile_model.py --list says so), the load packs
    the new weights and replaces it."""
    import compilation
    path = fresh_quantized(random_target, tmp_path, "int4-a8", 32)
    old_model, _ = load_counting_packs(path, monkeypatch)
    old_copy = packed_copies(path)
    [row] = [r for r in compilation.inventory(path.parent / "compiled") if r["kind"] == "packed copy"]
    assert row["stale"] is None
    checkpoint = torch.load(path, weights_only=True)
    weight = checkpoint["model"]["layers.0.attention.wqkv.weight"]
    weight.copy_(weight.flip(0))  # the same shapes, other weights
    torch.save(checkpoint, path)
    [row] = [r for r in compilation.inventory(path.parent / "compiled") if r["kind"] == "packed copy"]
    assert row["stale"] == "its weights file changed or is gone"
    model, packs = load_counting_packs(path, monkeypatch)
    assert packs == 1 and same_logits(model, packed_at_load(path, monkeypatch))
    assert not same_logits(model, old_model)
    assert len(packed_copies(path)) == 1 and packed_copies(path) != old_copy


@pytest.mark.parametrize("how", ["copied in", "changed in place", "signed by another key"])
def test_a_packed_copy_this_user_did_not_write_is_refused(how, random_target, tmp_path, monkeypatch, capsys):
    """A copy whose file is not the one this user's load wrote and signed (its bytes brought in by hand, changed
    since, or its metadata's signature made with another key) is refused and packed again, then stored anew."""
    path = fresh_quantized(random_target, tmp_path, "int4-a8", 32)
    load_counting_packs(path, monkeypatch)
    [copy] = packed_copies(path)
    if how == "copied in":  # the same bytes and metadata: another file
        data = copy.read_bytes()
        copy.unlink()
        copy.write_bytes(data)
    elif how == "changed in place":  # some weights overwritten, same size and name
        with open(copy, "r+b") as f:
            f.seek(copy.stat().st_size // 2)
            f.write(bytes(4096))
    else:
        meta_path = copy.with_suffix(".meta.json")
        meta = json.loads(meta_path.read_text())
        meta["signature"] = "0" * 64
        meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    model, packs = load_counting_packs(path, monkeypatch)
    assert packs == 1 and "refusing the packed copy" in capsys.readouterr().err
    assert same_logits(model, packed_at_load(path, monkeypatch))
    assert load_counting_packs(path, monkeypatch)[1] == 0  # the copy written again is this user's


def test_a_half_written_packed_copy_never_loads(random_target, tmp_path, monkeypatch, capsys):
    """A write cut short (a full disk) leaves no copy under its name, only one line on stderr; a published copy cut
    short later (a disk fault) is refused. Either way the model loads, packed at load."""
    path = fresh_quantized(random_target, tmp_path, "int8-a8", None)
    reference = packed_at_load(path, monkeypatch)
    save = torch.save

    def cut_short(obj, f, *args, **kwargs):
        if str(f).endswith(".pth") or "packed" not in str(f):
            return save(obj, f, *args, **kwargs)
        Path(f).write_bytes(b"PK\x03\x04 half")
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", cut_short)
        model, packs = load_counting_packs(path, monkeypatch)
    assert packs == 1 and "cannot store the packed copy" in capsys.readouterr().err
    assert packed_copies(path) == [] and not [p for p in (path.parent / "compiled").iterdir() if ".partial" in p.name]
    assert same_logits(model, reference)
    load_counting_packs(path, monkeypatch)
    [copy] = packed_copies(path)
    os.truncate(copy, copy.stat().st_size // 2)
    model, packs = load_counting_packs(path, monkeypatch)
    assert packs == 1 and "refusing the packed copy" in capsys.readouterr().err
    assert same_logits(model, reference)
