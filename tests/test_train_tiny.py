"""scripts/train_tiny.py: the offline pair is complete, loadable, deterministic and reports its figures."""
import json

import torch

import generate
from helpers import ROOT


def test_pair_layout_and_stats(trained_pair):
    for name in ("target", "draft"):
        d = trained_pair / name
        assert {"config.json", "tokenizer.model", "model.pth"} <= {p.name for p in d.iterdir()}
        assert not list(d.glob(".*.tmp"))
    assert (trained_pair / "target/tokenizer.model").read_bytes() == (trained_pair / "draft/tokenizer.model").read_bytes()
    stats = json.loads((trained_pair / "train_stats.json").read_text())
    assert stats["greedy_agreement"] >= 0.5  # the draft is useful for speculation even in the small preset
    for name in ("target", "draft"):
        # training did something: held-out loss well under a uniform guess
        assert stats[name]["heldout_loss"] < 0.8 * stats["uniform_loss"]
    assert stats["draft"]["params"] < stats["target"]["params"]
    other = trained_pair / "draft_othertok"
    assert {"config.json", "tokenizer.model", "model.pth"} <= {p.name for p in other.iterdir()}
    assert stats["draft_othertok"]["heldout_loss"] < 0.8 * stats["draft_othertok_uniform_loss"]
    heldout = (trained_pair / "heldout_files.txt").read_text().split()
    assert heldout and all(p.endswith(".py") for p in heldout)
    # the default precision: bf16 autocast only where this CPU multiplies bf16 natively (emulated, 10x slower)
    assert stats["precision"] == ("bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32")


def test_draft_with_its_own_tokenizer(trained_pair):
    """draft_othertok has a vocabulary of its own: another size, and other ids for the same text (digits kept
    together, where the target splits them one by one)."""
    from tokenizer import get_tokenizer
    target, other = get_tokenizer(trained_pair / "target"), get_tokenizer(trained_pair / "draft_othertok")
    assert other.vocab_size != target.vocab_size
    assert json.loads((trained_pair / "draft_othertok/config.json").read_text())["vocab_size"] == other.vocab_size
    text = "total = 12345\n"
    assert other.encode(text) != target.encode(text)
    assert other.decode(other.encode(text)) == target.decode(target.encode(text)) == text


def test_checkpoints_load_in_generate(trained_pair):
    stats = generate.main(["--checkpoint_path", str(trained_pair / "target/model.pth"), "--draft_checkpoint_path",
                           str(trained_pair / "draft/model.pth"), "--prompt", "import os\n", "--temperature", "0",
                           "--max_new_tokens", "12", "--num_samples", "1", "--speculate_k", "3"])
    assert len(stats["samples"][0]["tokens"]) <= 12 and stats["speculative"] == "draft"


def test_deterministic_with_seed(trained_pair, tmp_path):
    import train_tiny  # importable: the trained_pair fixture put scripts/ on the path
    train_tiny.main(["--preset", "test", "--out_dir", str(tmp_path), "--seed", "0"])
    for name in ("target", "draft", "draft_othertok"):
        a = torch.load(trained_pair / name / "model.pth", weights_only=True)
        b = torch.load(tmp_path / name / "model.pth", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_text_dir_and_clear_errors(tmp_path):
    import subprocess
    import sys
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "scripts/train_tiny.py"), "--preset", "test", "--text_dir",
                        str(empty), "--out_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode != 0 and "no text files" in r.stderr and "Traceback" not in r.stderr
