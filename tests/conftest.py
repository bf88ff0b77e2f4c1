"""Shared fixtures: checkpoints the tests build themselves (random weights, a tiny tokenizer)."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import SmallDisk, train_tokenizer, write_checkpoint

# the a8 kernels (kernels.a8_kernels) are built once per source and torch version: into the user's own cache, not
# once per test run
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                                                  / "fastgen" / "ext"))
# stored graphs are signed with a key in the user's cache directory: tests use their own, made by the first process
# (pytest-xdist's workers and every subprocess inherit it: they share the kernels kept there, artifacts.keep) and
# removed at its end
if "PYTEST_XDIST_WORKER" not in os.environ:
    TEST_CACHE = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fastgen-test-cache-")


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        shutil.rmtree(TEST_CACHE, ignore_errors=True)


torch.set_num_threads(1)  # tiny models: threading only adds overhead (and contention on shared CI cores)


@pytest.fixture(autouse=True)
def default_cpu_products(request, monkeypatch):
    """Whole CPU graphs build inductor's C++ GEMM template for every product of float weights
    (compilation.CPP_GEMM_OPTIONS), one compiler run per matmul shape: most of an in-process whole build, paid
    again in every test (frozen graphs are not cached). Tests marked gemm_templates keep them (their tokens
    equal eager decoding's: tests/test_decode.py, test_generate.py, test_stored.py); the other whole-graph tests
    check what runs around the products and take inductor's default lowering. Subprocesses keep the templates."""
    if "gemm_templates" not in request.keywords:
        import compilation
        monkeypatch.setattr(compilation, "CPP_GEMM_OPTIONS", {})


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tok", 512)


@pytest.fixture(scope="session")
def random_target(tmp_path_factory, tokenizer_model) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("target"), tokenizer_model, seed=0, dim=64, n_layer=2,
                            n_head=4, n_local_heads=2, vocab_size=512, block_size=256)


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory, tokenizer_model) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("draft"), tokenizer_model, seed=1, dim=32, n_layer=1,
                            n_head=2, vocab_size=512, block_size=256)


@pytest.fixture(params=["tmpfs", "ulimit"])
def small_disk(request, tmp_path):
    """A directory where writes can be made to fail as on a full disk (helpers.SmallDisk), both ways."""
    directory = tmp_path / "disk"
    directory.mkdir()
    if request.param == "tmpfs":
        try:
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(directory)],
                                     capture_output=True, text=True)
        except OSError as e:  # no mount command
            pytest.skip(f"cannot mount a tmpfs here: {e}")
        if mounted.returncode != 0:  # not root, or a container that forbids it
            pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()[:100]}")
    try:
        yield SmallDisk(request.param, directory)
    finally:
        if request.param == "tmpfs":
            subprocess.run(["umount", "-l", str(directory)], check=True)


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory) -> Path:
    """A real (barely) trained target/draft pair from scripts/train_tiny.py's test preset: OUT/{target,draft}.
    Trained once per test run: parallel workers (pytest-xdist) share it through a lock in their common directory."""
    import train_tiny
    from filelock import FileLock
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") \
        else tmp_path_factory.getbasetemp()
    out = shared / "trained_pair"
    with FileLock(str(shared / "trained_pair.lock")):
        if not (out / "train_stats.json").is_file():
            train_tiny.main(["--preset", "test", "--out_dir", str(out), "--seed", "0"])
    return out


# the longest modules first: with one module per worker (pytest-xdist --dist loadfile) the suite ends sooner when no
# long module starts last
LONGEST_FIRST = ["test_stored", "test_serve", "test_bench_scale", "test_bench_gpu", "test_crossdraft", "test_tree",
                 "test_drafthead", "test_speculative", "test_bad_input", "test_generate", "test_logprobs",
                 "test_grammar", "test_tp", "test_serve_tp", "test_bench_serve", "test_kernels", "test_batched",
                 "test_quantize", "test_eval", "test_decode", "test_train_tiny", "test_bad_runtime", "test_bad_files"]


def pytest_collection_modifyitems(config, items):
    """Every test that needs the trained pair trains it first (scripts/train_tiny.py): slow."""
    for item in items:
        if "trained_pair" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: each module keeps its order
