"""Stored compiled graphs (compilation.StoredForward, artifacts.py): the same tokens as eager and in-process compiled
engines, loaded by a later engine without building, and never used when anything in their key changed, when they
are truncated, or when someone else wrote them."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import artifacts
import compilation
import decode
import generation
import kernels
from helpers import ROOT, write_checkpoint


def inductor_cache(cache_dir: Path, built_by=None) -> Path:
    """A new inductor cache holding only the C++ libraries already built in built_by (default: this process's cache):
    no FX graph, AOTAutograd entry or generated Python, so what a run finds of its graphs is what CompileCache or a
    stored graph gives it, while g++ does not build the same kernel sources again in every run."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as shared
    for library in Path(built_by or shared()).glob("??/*.so"):
        (cache_dir / library.parent.name).mkdir(parents=True, exist_ok=True)
        for path in (library, library.with_suffix(".cpp")):
            if path.exists():
                shutil.copy(path, cache_dir / library.parent.name / path.name)
    return cache_dir


def run_script(script: str, checkpoint, cache_dir, threads: int = 1, built_by=None):
    """A script (formatted with the repository root and the checkpoint) in a new process with its own inductor cache
    (inductor_cache): (the JSON of its last line of output, its stderr)."""
    if not Path(cache_dir).exists():
        inductor_cache(Path(cache_dir), built_by)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", script.format(root=str(ROOT), path=str(checkpoint))],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def greedy(engine, prompt=(1, 5, 9, 2, 7), n=12):
    rows, _ = generation.generate(engine, torch.tensor(prompt), n, decode.Sampling(), [], stop_at_eos=False)
    return rows[0]


def stored_engine(path):
    model = generation.load_model(path)
    engine = decode.compile_engine(model, "cpu", "auto")
    assert engine.mode == "stored"
    return engine


def stored_anew(err: str) -> bool:
    """Whether a graph was stored in this call: built, or copied from the kernels kept for its shape."""
    return "compiling the graph of" in err or "copied from kernels this machine built" in err


def built(capsys) -> bool:
    return stored_anew(capsys.readouterr().err)


@pytest.fixture(scope="module")
def stored(tmp_path_factory, tokenizer_model):
    """One micro checkpoint for the tests that build its graph: built once, the later tests load it."""
    return write_checkpoint(tmp_path_factory.mktemp("stored") / "micro", tokenizer_model, seed=3, dim=32, n_layer=1,
                            n_head=2, vocab_size=512, block_size=64)


@pytest.fixture
def checkpoint(tmp_path, tokenizer_model):
    return write_checkpoint(tmp_path / "micro", tokenizer_model, seed=3, dim=32, n_layer=1, n_head=2,
                            vocab_size=512, block_size=64)


@pytest.mark.slow  # each build is a C++ compile of the whole model
@pytest.mark.gemm_templates
def test_stored_graph_equals_eager_and_compiled_and_is_loaded_not_rebuilt(stored, capsys):
    """Built once, stored beside the checkpoint; a new engine (as in a new process) loads it and decodes, verifies
    and prefills exactly what eager and in-process compiled engines do; a truncated package is refused with one
    line and rebuilt."""
    checkpoint = stored
    eager = greedy(decode.Engine(generation.load_model(checkpoint)))
    whole = greedy(decode.compile_engine(generation.load_model(checkpoint), "cpu", "whole"))
    assert greedy(stored_engine(checkpoint)) == eager == whole
    assert built(capsys)
    packages = list((checkpoint.parent / "compiled").glob("*.so"))
    assert len(packages) == 1
    assert json.loads(packages[0].with_name(packages[0].stem + ".meta.json").read_text())["signature"]
    if kernels.a8_kernels() and torch.ops.fastgen.a8_isa() == "avx512_vnni":  # float32 products: ours, called directly
        assert b"aoti_torch_cpu_f32_linear" in packages[0].read_bytes()
    engine = stored_engine(checkpoint)
    assert greedy(engine, prompt=(3, 4)) == greedy(decode.Engine(generation.load_model(checkpoint)), prompt=(3, 4))
    assert not built(capsys)

    # verification shapes (a tree under an explicit mask) through the same graph
    model = generation.load_model(checkpoint)
    model.setup_caches(1, 64)
    engine.model.setup_caches(1, 64)
    x = torch.tensor([[4, 8, 15, 16, 23, 42]])
    pos = torch.tensor([[0, 1, 2, 2, 3, 3]])
    slots = torch.arange(6).view(1, 6)
    mask = torch.zeros(1, 1, 6, engine.model.max_seq_length, dtype=torch.bool)
    for i, parent in enumerate([None, 0, 1, 1, 2, 3]):
        mask[0, 0, i, i] = True
        if parent is not None:
            mask[0, 0, i] |= mask[0, 0, parent]
    with torch.no_grad():
        expected = model(x, pos, slots, mask[..., :model.max_seq_length])
        torch.testing.assert_close(engine.forward(x, pos, slots, mask), expected, rtol=1e-4, atol=1e-4)

    data = packages[0].read_bytes()
    packages[0].unlink()  # a new file: this process still maps the one it loaded
    packages[0].write_bytes(data[: len(data) // 2])
    assert greedy(stored_engine(checkpoint)) == eager
    err = capsys.readouterr().err
    assert "refusing the stored graph" in err and stored_anew(err)


@pytest.mark.slow
def test_stored_graphs_hold_kernels_only_serve_every_cache_length_and_read_the_models_own_weights(stored, capsys):
    """A stored graph holds no copy of the weights and no cache length: one graph per batch size runs every cache
    length (three here, none built again), the graphs of two batch sizes in one process all read the model's own
    tensors (the same memory), no stored library and nothing the build left in inductor's cache holds a weight's
    bytes, and each call decodes what eager decoding does."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    started = time.time()
    engine = stored_engine(stored)
    model = engine.model
    x = torch.tensor([[4, 8, 15, 16, 23]])
    pos = torch.arange(5).view(1, 5)
    eager = generation.load_model(stored)
    with torch.no_grad():
        eager.setup_caches(2, 64)
        expected = eager(x.expand(2, 5), pos.expand(2, 5))
        for length in (16, 40, 64):
            model.setup_caches(1, length)
            assert model.max_seq_length == length
            torch.testing.assert_close(engine.forward(x, pos), expected[:1], rtol=1e-4, atol=1e-4)
            rebuilt = built(capsys)  # the first length may build the graph (a test before may have)
            assert length == 16 or not rebuilt, f"a cache of {length} slots built another graph"
        model.setup_caches(2, 64)
        torch.testing.assert_close(engine.forward(x.expand(2, 5), pos.expand(2, 5)), expected, rtol=1e-4, atol=1e-4)
    graphs = engine.stored.graphs
    assert set(graphs) == {(1, 1), (2, 2)}  # (batch, cache batch): one graph each, whatever the cache length
    own = {name: t.data_ptr() for name, t in engine.stored.constants().items()}
    for shape, (_, bind) in graphs.items():
        constants = bind.runner.extract_constants_map(False)
        weights = [name for name in constants if "kv_cache" not in name]  # the cache is an input, not a constant
        assert set(weights) == set(own), shape
        assert all(constants[name].data_ptr() == own[name] for name in weights), shape
    largest = max(engine.stored.constants().values(), key=torch.Tensor.numel)
    needle = largest.contiguous().view(-1)[largest.numel() // 2:][:32].numpy().tobytes()  # 128 random bytes
    libraries = list((stored.parent / "compiled").glob("*.so"))
    assert len(libraries) >= 2 and not any(needle in library.read_bytes() for library in libraries)
    assert all(library.stat().st_size < 16 << 20 for library in libraries)
    built_now = [f for f in Path(cache_dir()).rglob("*") if f.is_file() and f.stat().st_mtime >= started]
    assert not any(needle in f.read_bytes() for f in built_now)


HOLD_RUN = """
import json, os, sys, torch
sys.path.insert(0, {root!r})
import decode, generation, kernels

def rss():
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return int(status["VmRSS"].split()[0]) * 1024

kernels.a8_kernels()  # the code the model runs, loaded before counting
before = rss()
engine = decode.compile_engine(generation.load_model({path!r}), "cpu", "auto")
model = engine.model
storages = {{t.untyped_storage().data_ptr(): t.untyped_storage() for t in [*model.parameters(), *model.buffers()]}}
for storage in storages.values():  # every page read once, as a first forward reads them (the file's pages count)
    torch.empty(0, dtype=torch.uint8).set_(storage)[::4096].sum()
weights = os.path.getsize({path!r})  # the checkpoint's bytes: a copy the load made counts against them
loaded, growth, held = rss(), [], []
with torch.no_grad():
    for batch in (1, 2):
        for length in (64, 256):
            model.setup_caches(batch, length)
            engine.forward(torch.tensor([[4, 8, 15, 16, 23]]).expand(batch, 5), torch.arange(5).expand(batch, 5))
            caches = sum(t.nbytes for name, t in model.named_buffers() if "kv_cache" in name or name == "rope_table")
            growth.append(rss() - loaded - caches)
            held.append(rss() - before - caches)
print(json.dumps({{"weights": weights, "growth": growth, "held": held,
                  "graphs": sorted(f"b{{b}}of{{c}}" for (b, c), (_, bind) in engine.stored.graphs.items() if bind)}}))
"""


@pytest.mark.slow  # two builds, in a process of their own
def test_a_process_holding_two_batch_sizes_graphs_at_two_cache_lengths_holds_one_copy_of_the_weights(
        tmp_path, tokenizer_model):
    """By the RSS of a process of its own: a model whose weights (over 64 MB: a copy of them is far above what the RSS
    moves by otherwise) loads its stored graphs of batch 1 and 2, each run at two cache lengths, and the RSS grows
    beyond the loaded model and its caches by under a quarter of the weights, while all the process holds beyond what
    it held before loading, caches aside, stays under one and a half times the weights. A graph holding a copy of the
    weights (a binding not user-managed, say) grows it by a whole copy."""
    checkpoint = write_checkpoint(tmp_path / "wide", tokenizer_model, seed=5, dim=512, n_layer=2, n_head=8,
                                  n_local_heads=2, vocab_size=16384, block_size=256)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor_cache(tmp_path / "inductor")), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(ROOT / "scripts/compile_model.py"), "--checkpoint_path",
                           str(checkpoint), "--batch_size", "1", "2"], capture_output=True, text=True, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr
    held, err = run_script(HOLD_RUN, checkpoint, tmp_path / "inductor")
    assert "compiling the graph of" not in err  # loaded, as compile_model.py stored them
    assert held["graphs"] == ["b1of1", "b2of2"]
    assert held["weights"] > 64e6
    assert max(held["growth"]) < 0.25 * held["weights"], held
    assert max(held["held"]) < 1.5 * held["weights"], held  # a second copy anywhere: over twice the weights


@pytest.mark.slow
def test_cli_compile_stores_then_loads(stored, tmp_path):
    """generate.py --compile loads the graph stored by the test above (or builds it) and decodes the eager tokens,
    as a second run does; scripts/compile_model.py finds the graph already there."""
    checkpoint = stored
    from helpers import run
    plain = run(checkpoint, "--ignore_eos", "--temperature", "0", n=8)
    first = run(checkpoint, "--ignore_eos", "--temperature", "0", "--compile", n=8)
    second = run(checkpoint, "--ignore_eos", "--temperature", "0", "--compile", n=8)
    assert first["compile_mode"] == second["compile_mode"] == "stored"
    assert plain["samples"][0]["tokens"] == first["samples"][0]["tokens"] == second["samples"][0]["tokens"]
    done = subprocess.run([sys.executable, str(ROOT / "scripts/compile_model.py"), "--checkpoint_path", str(checkpoint),
                           "--speculate_k", "2", "--draft_ngram", "2"],
                          capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    assert not stored_anew(done.stderr) and "stored in" in done.stdout


@pytest.mark.slow
def test_compile_model_lists_and_prunes_stale_artifacts(stored):
    """scripts/compile_model.py --list shows every artifact of compiled/ with its size and why it is stale; --prune
    removes the stale (another weights file's identity, older code, a failed build's marker, unreadable metadata)
    and keeps what this machine would still load: the next run builds nothing."""
    greedy(stored_engine(stored), n=2)  # built by an earlier test, or here
    directory = stored.parent / "compiled"
    current = sorted(p.name for p in directory.iterdir())
    meta = json.loads(next(directory.glob(f"{stored.stem}-b1of1-stored-*.meta.json")).read_text())
    other_weights = dict(meta, fields=dict(meta["fields"], weights=dict(meta["fields"]["weights"], bytes=1)))
    older_code = dict(meta, fields=dict(meta["fields"], sources="0" * 64))
    (directory / "model-b3of3-stored-0000000000000000.so").write_bytes(b"\0" * 3000)
    (directory / "model-b3of3-stored-0000000000000000.meta.json").write_text(json.dumps(other_weights))
    (directory / "model-b5of5-stored-1111111111111111.so").write_bytes(b"\0" * 5000)
    (directory / "model-b5of5-stored-1111111111111111.meta.json").write_text(json.dumps(older_code))
    (directory / "model-b6of6-stored-2222222222222222.failed").write_text("key\nRuntimeError: no\n")
    (directory / "model-b7of7-s256-stored-3333333333333333.so").write_bytes(b"\0" * 7000)  # no metadata

    def compile_model(*flags):
        done = subprocess.run([sys.executable, str(ROOT / "scripts/compile_model.py"), "--checkpoint_path",
                               str(stored), *flags], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        return done.stdout
    listed = compile_model("--list")
    for name, why in [("model-b3of3", "its weights file changed"), ("model-b5of5", "built from older code"),
                      ("model-b6of6", "a failed build's marker"), ("model-b7of7", "no readable metadata")]:
        assert any(name in line and why in line for line in listed.splitlines()), (name, listed)
    assert len(list(directory.iterdir())) == len(current) + 6  # listing removes nothing
    pruned = compile_model("--prune")
    assert "removed" in pruned and sorted(p.name for p in directory.iterdir()) == current
    capsys_free = run_script(LOAD_RUN, stored, directory.parent / "inductor", torch.get_num_threads())[1]
    assert not stored_anew(capsys_free)


def key_for(path, **change):
    """The key StoredForward computes for `path`'s model, after `change` (threads, torch, mode)."""
    model = generation.load_model(path)
    model.setup_caches(1, 64)
    forward = compilation.StoredForward(model, "cpu", change.get("mode", "stored"))
    return artifacts.key_of(forward.key_fields(1, 1))


def test_every_key_component_changes_the_key(checkpoint, tmp_path, monkeypatch):
    """Weights (another model of the same shape, or the same file re-written), options, thread count and torch
    version each give another key: the stored graph of the old one is never found."""
    base = key_for(checkpoint)
    assert key_for(checkpoint) == base
    other = write_checkpoint(tmp_path / "other", checkpoint.parent / "tokenizer.model", seed=4, dim=32, n_layer=1,
                             n_head=2, vocab_size=512, block_size=64)
    assert key_for(other) != base
    assert key_for(checkpoint, mode="stored-autotune") != base
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert key_for(checkpoint) != base
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert key_for(checkpoint) != base
    monkeypatch.undo()
    state = torch.load(checkpoint, weights_only=True)
    state["norm.weight"] = state["norm.weight"] * 2
    torch.save(state, checkpoint)
    assert key_for(checkpoint) != base


def test_a_draft_heads_key_follows_its_weights_and_scheme(checkpoint, tmp_path):
    """A head's stored graphs are keyed by the head's own weights file and scheme (and its target's width through
    its config): another head of the same shape, or the same head in float32 instead of int8, is another key."""
    from drafthead import load_head, save_head
    from test_drafthead import random_head
    model = generation.load_model(checkpoint)

    def key(directory, int8=True):
        head = load_head(directory, model, int8=int8)
        head.setup_caches(1, 64)
        return artifacts.key_of(compilation.StoredHead(head, "cpu", "stored").key_fields(1, 1))
    save_head(random_head(model, 256, seed=6), tmp_path / "head")
    base = key(tmp_path / "head")
    assert key(tmp_path / "head") == base
    assert key(tmp_path / "head", int8=False) != base
    save_head(random_head(model, 256, seed=7), tmp_path / "head")
    assert key(tmp_path / "head") != base


def test_find_refuses_foreign_stale_and_truncated_packages(tmp_path, monkeypatch):
    """find() returns a package only with its key and this user's signature: one signed under another user's key
    (copied in with a checkpoint), one built for another key, one changed after signing are all refused."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "mine"))
    directory = tmp_path / "compiled"
    artifacts.store(directory, "model-b1-k", "KEY", {"x": 1}, lambda tmp: tmp.write_bytes(b"package" * 100) and "{}")
    assert artifacts.find(directory, "model-b1-k", "KEY") == (directory / "model-b1-k.so", None)
    assert artifacts.find(directory, "model-b1-k", "OTHER")[1] == "it was built for other weights, options or software"
    assert artifacts.find(directory, "missing", "KEY") == (None, None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "someone else"))
    assert "not built on this machine" in artifacts.find(directory, "model-b1-k", "KEY")[1]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "mine"))
    table = directory / "model-b1-k.json"  # the operator table the runner reads beside the library is signed too
    table.write_text('{"extern": 1}')
    assert "not built on this machine" in artifacts.find(directory, "model-b1-k", "KEY")[1]
    table.write_text("{}")
    assert artifacts.find(directory, "model-b1-k", "KEY")[1] is None
    package = directory / "model-b1-k.so"
    package.write_bytes(package.read_bytes()[:50])
    assert "not built on this machine" in artifacts.find(directory, "model-b1-k", "KEY")[1]
    # a newer key for the same graph replaces the old package (no growing pile of stale graphs)
    artifacts.store(directory, "model-b1-k2", "KEY2", {"x": 2}, lambda tmp: tmp.write_bytes(b"new") and None)
    assert sorted(p.name for p in directory.iterdir()) == ["model-b1-k2.meta.json", "model-b1-k2.so"]
    key = tmp_path / "mine" / "fastgen" / "artifact.key"
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    os.chmod(key, 0o644)
    with pytest.raises(PermissionError):
        artifacts.signing_key()


def test_read_only_checkpoint_directory_stores_in_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    directory = tmp_path / "ro"
    directory.mkdir()
    assert artifacts.directory_for(directory / "model.pth") == directory / "compiled"
    os.chmod(directory, 0o555)
    try:
        if os.access(directory, os.W_OK):  # root writes anywhere
            pytest.skip("this user can write to read-only directories")
        assert artifacts.directory_for(directory / "model.pth").is_relative_to(tmp_path / "cache")
    finally:
        os.chmod(directory, 0o755)
    shutil.rmtree(directory)


@pytest.mark.slow
def test_speculative_decoding_on_stored_graphs_equals_plain(stored, tmp_path):
    """A draft model (chain and tree) and n-gram lookups verified through the stored graphs (every verification
    width through the one dynamic graph, the draft's graph too) give plain greedy decoding's tokens."""
    checkpoint = stored
    from helpers import copy_checkpoint
    draft = copy_checkpoint(checkpoint, tmp_path / "draft", noise=0.02, seed=5)
    prompt = [1, 5, 9, 2, 7, 5, 9, 2]
    plain = generation.Generator.build(checkpoint).generate(prompt, 24, decode.Sampling(), stop_at_eos=False)[0]
    for draft_path, speculation in ((draft, generation.Speculation(3)), (draft, generation.Speculation(3, 6)),
                                    (None, generation.Speculation(3, draft_ngram=2))):
        generator = generation.Generator.build(checkpoint, draft_checkpoint_path=draft_path, speculation=speculation,
                                               compile="auto")
        assert generator.target.mode == "stored"
        rows, stats = generator.generate(prompt, 24, decode.Sampling(), stop_at_eos=False)
        assert rows == plain, speculation
        assert draft_path is None or sum(stats["accept_counts"][1:]) > 0  # drafts were accepted: verification ran


@pytest.mark.slow
def test_auto_keeps_its_timings_beside_the_stored_graphs(stored, monkeypatch, capsys):
    """`auto` on stored graphs: the timings of a run are stored beside the graphs, keyed by the configuration; the
    next run of the same configuration starts from them (it does not time a plain step first) and still gives plain
    decoding's tokens; another configuration (here the n-gram's n) has its own; a damaged file is replaced."""
    import speculate
    prompt = [1, 5, 9, 2, 7, 5, 9, 2]
    plain = generation.Generator.build(stored).generate(prompt, 24, decode.Sampling(), stop_at_eos=False)[0]
    directory = artifacts.directory_for(stored)

    def run(n):
        speculation = generation.Speculation("auto", draft_ngram=n)
        generator = generation.Generator.build(stored, speculation=speculation, compile="auto")
        assert generator.target.mode == "stored"
        rows, _ = generator.generate(prompt, 24, decode.Sampling(), stop_at_eos=False)
        assert rows == plain
        return generator.speculator.auto

    first = run(2)
    files = sorted(directory.glob("auto-timings-*.json"))
    assert len(files) == 1 and first.store.path == files[0]
    kept = json.loads(files[0].read_text())
    assert [1, 1] in [row[:2] for row in kept["verify"]]  # plain decoding's step, timed before the first choice
    monkeypatch.setattr(speculate, "plain_step_seconds", lambda *a, **k: pytest.fail("timed again"))
    second = run(2)
    assert second.store.path == files[0]
    assert second.verify_cost(1, 1) > 0
    monkeypatch.undo()
    run(3)
    assert len(list(directory.glob("auto-timings-*.json"))) == 2
    files[0].write_text("{not json")
    capsys.readouterr()
    run(2)
    assert "ignoring the stored timings" in capsys.readouterr().err
    assert json.loads(files[0].read_text())["key"] == kept["key"]


@pytest.mark.slow
def test_draft_head_and_a8_kernels_on_stored_graphs(stored, tmp_path, capsys):
    """The features graph a draft head reads (Engine.forward_features), the head's own graph (stored beside its
    weights, loaded by the next run) and a model whose layers call the a8 custom operators (through their C entry
    points, kernels.c_shims) are stored and loaded like any graph, and give eager decoding's tokens."""
    from drafthead import save_head
    from test_drafthead import random_head
    import quantize
    checkpoint = stored
    prompt = [1, 5, 9, 2, 7, 5, 9, 2]
    plain = generation.Generator.build(checkpoint).generate(prompt, 20, decode.Sampling(), stop_at_eos=False)[0]
    save_head(random_head(generation.load_model(checkpoint), 256, seed=6), tmp_path / "head")
    for speculation in (generation.Speculation(3, 6), generation.Speculation(2)):  # a tree, then a chain
        generator = generation.Generator.build(checkpoint, draft_head=tmp_path / "head", compile="auto",
                                               speculation=speculation)
        assert generator.target.mode == "stored"
        capsys.readouterr()
        rows, stats = generator.generate(prompt, 20, decode.Sampling(), stop_at_eos=False)
        assert rows == plain and stats["drafted"] > 0
        assert built(capsys) == (speculation.nodes == 6)  # built once
    assert list((checkpoint.parent / "compiled").glob("*-f*.so"))  # the features graph
    assert len(list((tmp_path / "head" / "compiled").glob("head-b1of1-*.so"))) == 1  # the head's, beside it
    spec = importlib.util.spec_from_file_location("compile_model", ROOT / "scripts" / "compile_model.py")
    compile_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_model)
    rows = compile_model.compile_model(checkpoint, speculation=generation.Speculation(2), draft_head=tmp_path / "head")
    assert not built(capsys)  # everything the configuration needs is there
    assert [row["stem"] for row in rows] == [checkpoint.stem, "head"]
    # quantized layers call their operators' C entry points directly, not boxed through the proxy executor; the
    # weight-only int4 graph reads no constant inductor made itself (its lowering turns the group size into one)
    for scheme, groupsize, shim in (("int8-a8", None, b"aoti_torch_cpu_a8_int8_linear"),
                                    ("int4", 32, b"aoti_torch_cpu_int4mm_packed_weight_cpu")):
        quantized = quantize.quantize_checkpoint(checkpoint, scheme, groupsize)
        eager = generation.Generator.build(quantized).generate(prompt, 20, decode.Sampling(), stop_at_eos=False)[0]
        for _ in range(2):  # built, then loaded
            capsys.readouterr()
            graphs = generation.Generator.build(quantized, compile="auto")
            assert graphs.generate(prompt, 20, decode.Sampling(), stop_at_eos=False)[0] == eager
            assert "compiling it in this process" not in capsys.readouterr().err
        libraries = list((checkpoint.parent / "compiled").glob(f"{quantized.stem}-*.so"))
        assert len(libraries) == 1 and shim in libraries[0].read_bytes()
        assert not list((checkpoint.parent / "compiled").glob(f"{quantized.stem}-*.failed"))


KERNELS_RUN = """
import json, sys, torch
sys.path.insert(0, {root!r})
from torch._dynamo.utils import counters
import decode, generation
torch.set_num_threads(1)
engine = decode.compile_engine(generation.load_model({path!r}), "cpu", "regional")
rows, _ = generation.generate(engine, torch.tensor([1, 5, 9, 2, 7]), 6, decode.Sampling(), [], stop_at_eos=False)
print(json.dumps({{"tokens": rows[0], "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "hits": counters["inductor"]["fxgraph_cache_hit"]}}))
"""


@pytest.mark.slow  # three processes, each compiling or loading the regional graphs
def test_in_process_graphs_store_their_kernels_and_a_later_process_compiles_nothing(checkpoint, tmp_path):
    """Modes compiled in the process (CUDA's whole graphs, regions on CPU) store their kernels beside the checkpoint
    (compilation.CompileCache): a later process with an empty inductor cache generates the same tokens with no graph
    code-generated again (g++ still builds the C++ kernels' source there); a changed (or foreign) kernel file is
    refused with one line and written again."""
    def run(name):
        built_by = None if name == "first" else tmp_path / "first"
        return run_script(KERNELS_RUN, checkpoint, tmp_path / name, built_by=built_by)

    first, _ = run("first")
    stored = list((checkpoint.parent / "compiled").glob(f"{checkpoint.stem}-kernels-regional-*.bin"))
    assert first["misses"] > 0 and len(stored) == 1
    second, err = run("second")
    assert second["tokens"] == first["tokens"] and second["misses"] == 0 and second["hits"] > 0, (first, second)
    assert "refusing" not in err
    stored[0].write_bytes(stored[0].read_bytes()[:-8] + b"tampered")
    third, err = run("third")
    assert third["tokens"] == first["tokens"] and third["misses"] > 0
    assert err.count("refusing the stored kernels") == 1 and "not built on this machine" in err
    meta = json.loads(stored[0].with_suffix(".meta.json").read_text())  # written again, signed again
    assert meta["signature"] == artifacts.signature(stored[0], meta["key"])


FALLBACK_RUN = """
import json, sys, torch
sys.path.insert(0, {root!r})
from torch._dynamo.utils import counters
import compilation, decode, generation
torch.set_num_threads(1)
def fails(*args):
    raise RuntimeError("cannot export this model")
compilation.StoredForward.export = fails
compilation.graph_options = lambda model, device, mode: {{"options": {{"freezing": False}}}}  # frozen: not cacheable
engine = decode.compile_engine(generation.load_model({path!r}), "cpu", "auto")
rows, _ = generation.generate(engine, torch.tensor([1, 5, 9, 2, 7]), 6, decode.Sampling(), [], stop_at_eos=False)
print(json.dumps({{"tokens": rows[0], "misses": counters["inductor"]["fxgraph_cache_miss"],
                  "hits": counters["inductor"]["fxgraph_cache_hit"]}}))
"""


@pytest.mark.slow  # two processes compiling or loading a whole graph
def test_a_shape_compiled_in_the_process_instead_keeps_its_kernels(checkpoint, tmp_path, monkeypatch):
    """Where a stored graph cannot be built (or loaded) here, that shape is compiled in the process, and its kernels
    are stored like an in-process engine's (compilation.CompileCache): later processes, each with an empty inductor
    cache and the failure marker, give the same tokens and load the graphs' code instead of generating it (the second
    process traced one of the two graphs differently from the first and compiled it; from the third on, nothing)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no kernels kept for this shape: it builds

    def run(name):
        built_by = None if name == "first" else tmp_path / "first"
        return run_script(FALLBACK_RUN, checkpoint, tmp_path / name, built_by=built_by)

    first, err = run("first")
    assert "cannot store" in err and first["misses"] > 0
    assert len(list((checkpoint.parent / "compiled").glob(f"{checkpoint.stem}-kernels-whole-*.bin"))) == 1
    second, err = run("second")
    third, _ = run("third")
    assert "could not be stored here" in err
    assert second["tokens"] == third["tokens"] == first["tokens"]
    assert second["hits"] > 0 and second["misses"] < first["misses"], (first, second)
    assert third["misses"] == 0 and third["hits"] == first["misses"], (first, third)


LOAD_RUN = """
import json, sys, torch
sys.path.insert(0, {root!r})
import decode, generation
generator = generation.Generator.build({path!r}, compile="auto")
rows, _ = generator.generate([1, 5, 9, 2, 7], 6, decode.Sampling(), stop_at_eos=False)
print(json.dumps({{"tokens": rows, "mode": generator.target.mode,
                  "compiler": sorted(m for m in ("torch._inductor", "torch._dynamo") if m in sys.modules)}}))
"""


@pytest.mark.slow  # a build in the first process
def test_a_process_that_loads_a_stored_graph_imports_no_compiler(stored, tmp_path):
    """Loading and running a stored graph needs AOTInductor's runner only: a later process never imports inductor or
    dynamo (seconds of a launch), and decodes what the building process decoded."""
    def run():  # at this process's thread count: the graph the tests before built, if any
        return run_script(LOAD_RUN, stored, tmp_path / "inductor", torch.get_num_threads())[0]
    first, later = run(), run()  # the first may build the graph (this process's thread count is part of its key)
    assert later["mode"] == "stored" and later["compiler"] == [] and later["tokens"] == first["tokens"]


@pytest.mark.slow
def test_a_built_graph_is_tried_in_a_child_process(stored):
    """What a CUDA build does before storing its graph (AOTInductor's loader crashed on a GPU measured): the library
    with its operator table loads and runs in a child process; a broken one is reported, not loaded here."""
    engine = stored_engine(stored)
    greedy(engine, n=2)  # built by an earlier test, or here
    library = next((stored.parent / "compiled").glob(f"{stored.stem}-b1of1-stored-*.so"))  # not the a8 copy's
    table = library.with_suffix(".json").read_text() if library.with_suffix(".json").exists() else None
    examples = [engine.stored.example(1, 1, tokens) for tokens in (1, 4)]
    constants = engine.stored.constants()
    compilation.loads_in_child(library, table, "cpu", examples, constants=constants)
    broken = library.parent / "broken.so"
    broken.write_bytes(library.read_bytes()[:4096])
    try:
        with pytest.raises(RuntimeError, match="child process failed"):
            compilation.loads_in_child(broken, table, "cpu", examples, constants=constants)
    finally:
        broken.unlink()


def test_a_crash_in_the_child_is_reported_as_a_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(compilation, "CHILD_CHECK", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    library = tmp_path / "graph.so"
    library.write_bytes(b"\0")
    with pytest.raises(compilation.LoaderCrashed, match="signal 11"):
        compilation.loads_in_child(library, None, "cuda", [compilation.example_inputs(1, 64, "cpu", 1)])
    assert list(tmp_path.iterdir()) == [library]  # its check directory removed


def test_a_hang_in_the_child_is_a_loader_failure_and_ends(tmp_path, monkeypatch):
    """A loader that hangs (as AOTInductor's did on a GPU measured) is stopped after the timeout and reported like a
    crash, so that the machine is marked and no later build waits on it again."""
    monkeypatch.setattr(compilation, "CHILD_CHECK", "import time; time.sleep(60)")
    library = tmp_path / "graph.so"
    library.write_bytes(b"\0")
    start = time.monotonic()
    with pytest.raises(compilation.LoaderCrashed, match="hung"):
        compilation.loads_in_child(library, None, "cuda", [compilation.example_inputs(1, 64, "cpu", 1)], timeout=1)
    assert time.monotonic() - start < 30
    assert list(tmp_path.iterdir()) == [library]


def test_a_graph_that_cannot_be_stored_is_not_built_again_in_every_run(checkpoint, tmp_path, monkeypatch, capsys):
    """A build that fails (an export error, a library that does not load) leaves a marker under its key: a later
    run with the same key compiles that shape in its process at once (one line); another key tries again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no kernels kept for this shape: it builds

    def fails(*args):
        raise RuntimeError("cannot export this model")

    def forward():
        model = generation.load_model(checkpoint)
        model.setup_caches(1, 64)
        return compilation.StoredForward(model, "cpu", "stored")
    monkeypatch.setattr(compilation.StoredForward, "export", fails)
    run, bind = forward().load(1, 1)
    assert bind is None and callable(run)
    assert "cannot store" in capsys.readouterr().err
    assert len(list((checkpoint.parent / "compiled").glob("*.failed"))) == 1
    monkeypatch.setattr(compilation.StoredForward, "export", lambda *args: pytest.fail("built again"))
    run, bind = forward().load(1, 1)
    assert bind is None and callable(run)
    err = capsys.readouterr().err
    assert "could not be stored here (RuntimeError: cannot export this model)" in err and len(err.splitlines()) == 1
    monkeypatch.setattr(compilation.StoredForward, "export", fails)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # another key
    try:
        forward().load(1, 1)
    finally:
        torch.set_num_threads(threads)
    assert "cannot store" in capsys.readouterr().err


def test_stats_say_the_graphs_ran_in_the_process_where_none_could_be_stored(checkpoint, tmp_path, monkeypatch,
                                                                             capsys):
    """`--compile` whose graphs could not be stored here compiles them in the process: its stats JSON says
    `whole`, not `stored`."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no kernels kept for this shape: it builds

    def fails(*args):
        raise RuntimeError("cannot export this model")
    monkeypatch.setattr(compilation.StoredForward, "export", fails)
    # the in-process graph itself is the whole mode's (tested with it); eager here keeps this test fast
    monkeypatch.setattr(compilation.StoredForward, "compiled_in_process", lambda self: self.model)
    stats = generation.run(generation.Settings(checkpoint_path=checkpoint, prompt="hello", num_samples=1,
                                               max_new_tokens=4, temperature=0, compile="auto"), say=lambda *a: None)
    assert stats["compile_mode"] == "whole" and "cannot store" in capsys.readouterr().err
    engine = decode.compile_engine(generation.load_model(checkpoint), "cpu", "auto")
    assert engine.ran_as == "stored"  # before any graph is loaded: the mode asked for


@pytest.mark.slow
def test_another_weights_file_of_a_built_shape_takes_a_copy_of_its_kernels(tmp_path, tokenizer_model, monkeypatch,
                                                                            capsys):
    """A stored graph's kernels do not depend on the weights' values: a second checkpoint of the same shape and
    settings (other random weights) gets a copy of the first one's kernels, not a build, signed under its own key,
    and decodes its own weights' eager tokens. A kept copy changed since it was kept is refused (a build), and the
    kept kernels are bounded (least recently used out)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    paths = [write_checkpoint(tmp_path / f"m{seed}", tokenizer_model, seed=seed, dim=32, n_layer=1, n_head=2,
                              vocab_size=512, block_size=64) for seed in (3, 4, 5)]
    eager = [greedy(decode.compile_engine(generation.load_model(path), "cpu", "none")) for path in paths]
    assert eager[0] != eager[1]  # the copy must read its own weights to pass
    assert greedy(stored_engine(paths[0])) == eager[0]
    assert "compiling the graph of" in capsys.readouterr().err
    monkeypatch.setattr(compilation.StoredForward, "export", lambda *args: pytest.fail("built again"))
    assert greedy(stored_engine(paths[1])) == eager[1]
    assert "copied from kernels this machine built" in capsys.readouterr().err
    metas = [json.loads(next((p.parent / "compiled").glob("*.meta.json")).read_text()) for p in paths[:2]]
    assert metas[0]["key"] != metas[1]["key"] and metas[0]["fields"]["weights"] != metas[1]["fields"]["weights"]
    [library] = (paths[1].parent / "compiled").glob("*.so")
    assert artifacts.find(library.parent, library.stem, metas[1]["key"]) == (library, None)  # signed as built here
    [kept] = artifacts.kept_directory().glob("*.so")
    data = bytearray(kept.read_bytes())
    data[len(data) // 2] ^= 1
    kept.write_bytes(bytes(data))

    def fails(*args):
        raise RuntimeError("cannot export this model")
    monkeypatch.setattr(compilation.StoredForward, "export", fails)
    greedy(stored_engine(paths[2]))
    assert "cannot store" in capsys.readouterr().err  # the changed copy was not taken: it tried to build
    for i in range(3):  # three other settings' kernels, at most two kept: the oldest goes
        artifacts.keep(library, dict(metas[1]["fields"], options={"n": i}), count=2)
        time.sleep(0.01)
    assert len(list(artifacts.kept_directory().glob("*.so"))) == 2
    assert all(artifacts.kernels_key(dict(metas[1]["fields"], options={"n": i}))[:32] in
               {p.stem for p in artifacts.kept_directory().glob("*.so")} for i in (1, 2))


def test_a_loader_that_crashed_is_given_no_other_graph_to_build(checkpoint, tmp_path, monkeypatch, capsys):
    """A child process killed by a signal while loading a fresh graph marks the machine (this torch, this device):
    a later run builds no graph of any key or model to store (minutes each, and each would crash) but compiles it in
    the process at once, with one line saying how to try again; a build that fails otherwise marks nothing."""
    import artifacts
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def forward(threads):
        torch.set_num_threads(threads)  # part of the key: each thread count is another graph
        model = generation.load_model(checkpoint)
        model.setup_caches(1, 64)
        return compilation.StoredForward(model, "cpu", "stored")

    def fails(*args):
        raise RuntimeError("loading it in a child process failed (exit 1: a wrong output)")

    def crashes(*args):
        raise compilation.LoaderCrashed("loading it in a child process failed (signal 11)")
    threads = torch.get_num_threads()
    try:
        monkeypatch.setattr(compilation.StoredForward, "export", fails)
        forward(threads + 1).load(1, 1)
        assert "cannot store" in capsys.readouterr().err and not artifacts.loader_crashed("cpu")
        monkeypatch.setattr(compilation.StoredForward, "export", crashes)
        forward(threads + 2).load(1, 1)
        assert "signal 11" in capsys.readouterr().err and artifacts.loader_crashed("cpu")
        monkeypatch.setattr(compilation.StoredForward, "export", lambda *args: pytest.fail("built again"))
        run, bind = forward(threads + 3).load(1, 1)
        assert bind is None and callable(run)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "not storing" in err[0] and "loader-crashed to try again" in err[0]
    finally:
        torch.set_num_threads(threads)


class FakeCudaGraphs:
    """torch.cuda's graph API with a CUDA graph's semantics on the CPU: capture records the call, replay runs it
    again on the captured inputs and writes into the captured outputs."""

    def __init__(self, monkeypatch, differ=False):
        self.capturing, self.differ = None, differ
        fakes = self

        class Graph:
            def replay(self):
                fresh = self.call()
                for out, new in zip(self.outputs, fresh):
                    out.copy_(new + 1 if fakes.differ else new)

        class capture:
            def __init__(self, graph):
                self.graph = graph

            def __enter__(self):
                fakes.capturing = self.graph

            def __exit__(self, *exc):
                fakes.capturing = None
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", capture)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_stored_cuda_graphs_replay_few_token_calls_only_where_the_replay_equals_the_direct_run(monkeypatch, capsys):
    """compilation.Replayed's bookkeeping (the CUDA graph API faked on the CPU): the first call of a shape runs
    directly, the second captures and checks a replay against the direct run, later calls copy their inputs in and
    replay; long calls always run directly; new cache tensors drop the captures; a replay that differs is never
    used."""
    fakes = FakeCudaGraphs(monkeypatch)
    calls = []

    def run(x, pos):
        calls.append(fakes.capturing is None)
        out = [x * 2 + pos]
        if fakes.capturing is not None:
            fakes.capturing.call, fakes.capturing.outputs = (lambda: [x * 2 + pos]), out
        return out
    replayed = compilation.Replayed(run)
    for i in range(4):
        x, pos = torch.full((1, 1), i), torch.full((1, 1), 10 * i)
        assert replayed(x, pos)[0].item() == 2 * i + 10 * i
    assert calls == [True, True, False]  # direct, direct (expected), capture; the last two calls replayed
    assert replayed(torch.ones(1, 20), torch.ones(1, 20))[0].shape == (1, 20) and calls[-1] is True
    replayed.reset()
    calls.clear()
    replayed(torch.ones(1, 1), torch.ones(1, 1))
    assert calls == [True]

    fakes.differ = True
    replayed = compilation.Replayed(run)
    results = [replayed(torch.full((1, 1), i), torch.zeros(1, 1))[0].item() for i in range(4)]
    assert results == [0, 2, 4, 6]
    assert "not replayed from a CUDA graph (its replay differs" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a full disk (conftest.small_disk)

def full_disk_run(disk, room: int, call, capsys) -> list:
    """call() run as a command runs it (errors.run_cli) with `room` bytes left on the disk: exit status 1, no
    traceback, every file under the disk as it was (no temp file left); returns its stderr's lines."""
    import errors
    from helpers import files_of
    before = files_of(disk.directory)
    with disk.full(room):
        status = errors.run_cli(call)
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err, err
    assert files_of(disk.directory) == before
    return err.strip().splitlines()


def test_a_full_disk_while_storing_a_graph_is_one_line_and_leaves_no_marker(small_disk, tokenizer_model, monkeypatch,
                                                                           capsys):
    """The build's library written on a full disk: the export patched to write it with torch's zip writer (as
    AOTInductor's packager writes its .pt2), so the failure is torch's own RuntimeError of a real full disk. One
    line naming the library, and no `.failed` marker: a full disk says nothing about the graph, and the next run
    with room builds it."""

    def export(self, example, tmp):
        torch.save({"library": torch.zeros(1 << 18)}, tmp)
    monkeypatch.setattr(compilation.StoredForward, "export", export)
    checkpoint = write_checkpoint(small_disk.directory / "micro", tokenizer_model, seed=3, dim=32, n_layer=1,
                                  n_head=2, vocab_size=512, block_size=64)
    model = generation.load_model(checkpoint)
    model.setup_caches(1, 64)
    forward = compilation.StoredForward(model, "cpu", "stored")
    lines = full_disk_run(small_disk, 64 << 10, lambda: forward.load(1, 1), capsys)
    compiled = checkpoint.parent / "compiled"
    assert lines[-1].startswith(f"error: {small_disk.cause}: {compiled}/model-") and ".so: " in lines[-1], lines
    assert not any("cannot store" in line for line in lines), lines
    assert not list(compiled.glob("*.failed"))


def test_a_full_disk_while_keeping_compiled_kernels_is_one_line(small_disk, tokenizer_model, monkeypatch, capsys):
    """An in-process compile's kernels (compilation.CompileCache, NAME.bin) stored on a full disk: torch's cache
    artifacts patched to a blob of 1 MiB, written by the real writer."""
    checkpoint = write_checkpoint(small_disk.directory / "micro", tokenizer_model, seed=3, dim=32, n_layer=1,
                                  n_head=2, vocab_size=512, block_size=64)
    cache = compilation.CompileCache(generation.load_model(checkpoint), "cpu", "whole")
    monkeypatch.setattr(compilation, "compiled_count", lambda: cache.compiled + 1)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (bytes(1 << 20), None))
    lines = full_disk_run(small_disk, 64 << 10, cache.save_if_new, capsys)
    assert lines == [f"error: {small_disk.cause}: {cache.directory / cache.name}.bin: "
                     f"{lines[0].rsplit(': ', 1)[-1]}"], lines


def test_a_full_disk_while_making_the_signing_key_leaves_no_short_key(small_disk, monkeypatch, capsys):
    """The key that signs stored graphs is written whole or not at all: a key cut short would sign with fewer secret
    bytes (an empty one with none)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(small_disk.directory))
    lines = full_disk_run(small_disk, 16, artifacts.signing_key, capsys)
    assert lines == [f"error: {small_disk.cause}: {small_disk.directory / 'fastgen' / 'artifact.key'}: "
                     f"{lines[0].rsplit(': ', 1)[-1]}"], lines
    assert not (small_disk.directory / "fastgen" / "artifact.key").exists()
    assert len(artifacts.signing_key()) == artifacts.KEY_BYTES  # with room: made whole


@pytest.mark.slow  # a build
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tied_output_layer_is_read_from_the_tables_weight(precision, tmp_path, tokenizer_model, capsys):
    """A tied output layer's weight is the embedding table's: export may name it after either module, so a stored
    graph is handed it under both names (before, a bf16 model's graph was refused at load and compiled in every
    process instead)."""
    path = write_checkpoint(tmp_path / "tied", tokenizer_model, seed=3, dim=32, n_layer=1, n_head=2, vocab_size=512,
                            block_size=64, tie_word_embeddings=True)
    want = greedy(decode.compile_engine(generation.load_model(path, precision=precision), "cpu", "none"))
    for build in (True, False):
        engine = decode.compile_engine(generation.load_model(path, precision=precision), "cpu", "auto")
        assert greedy(engine) == want and engine.ran_as == "stored"
        assert built(capsys) == build
