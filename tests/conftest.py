"""Shared fixtures: checkpoints the tests build themselves (random weights, a tiny tokenizer)."""
import json
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from model import ModelArgs, Transformer  # noqa: E402

torch.set_num_threads(1)  # tiny models: threading only adds overhead (and contention on shared CI cores)


def train_tokenizer(prefix: Path, vocab_size: int) -> Path:
    import sentencepiece as spm
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text.splitlines()), model_prefix=str(prefix),
                                   vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   num_threads=1, minloglevel=2)
    return prefix.with_suffix(".model")


def write_checkpoint(directory: Path, tokenizer_model: Path, seed: int = 0, **model_args) -> Path:
    """A checkpoint dir in the DESIGN.md layout with random weights; returns the model.pth path."""
    directory.mkdir(parents=True, exist_ok=True)
    args = ModelArgs(**model_args)
    torch.manual_seed(seed)
    model = Transformer(args)
    (directory / "config.json").write_text(json.dumps(args.to_hf_config()))
    (directory / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    torch.save(model.state_dict(), directory / "model.pth")
    return directory / "model.pth"


def copy_checkpoint(source, directory, noise=0.0, sharpen=1.0, seed=0, **config):
    """A checkpoint directory with `source`'s weights plus Gaussian noise (`noise` times each tensor's std),
    its output layer scaled by `sharpen` (more confident, same argmax), and config.json entries replaced."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(source.parent / "tokenizer.model", directory)
    hf_config = json.loads((source.parent / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(hf_config, **config)))
    generator = torch.Generator().manual_seed(seed)
    state = {name: w + noise * w.std() * torch.randn(w.shape, generator=generator)
             for name, w in torch.load(source, weights_only=True).items()}
    state["output.weight"] = state["output.weight"] * sharpen
    torch.save(state, directory / "model.pth")
    return directory / "model.pth"


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


@pytest.fixture(scope="session")
def trained_pair(tmp_path_factory) -> Path:
    """A real (barely) trained target/draft pair from scripts/train_tiny.py's test preset: OUT/{target,draft}."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny
    out = tmp_path_factory.mktemp("trained")
    train_tiny.main(["--preset", "test", "--out_dir", str(out), "--seed", "0"])
    return out
