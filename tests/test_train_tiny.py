"""scripts/train_tiny.py: the offline pair is complete, loadable, deterministic and reports its figures."""
import json
import os

import pytest
import torch

import generation
from helpers import cli, ROOT

pytestmark = pytest.mark.slow  # trains the tiny pair


def test_pair_layout_and_stats(trained_pair):
    for name in ("target", "draft"):
        d = trained_pair / name
        assert {"config.json", "tokenizer.model", "model.pth"} <= {p.name for p in d.iterdir()}
        assert not list(d.glob(".*.tmp"))
    target_tokenizer = (trained_pair / "target/tokenizer.model").read_bytes()
    assert target_tokenizer == (trained_pair / "draft/tokenizer.model").read_bytes()
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


def test_target_continuations_for_the_other_vocabulary(trained_pair):
    """draft_othertok's imitation text: even rows continue their training-text window as the target decodes greedily
    (generate.py's output, token for token), odd rows are draws (same seed, same rows); retokenize() carries each
    row's text, byte for byte, into the other vocabulary, BOS / EOS kept."""
    import dataclasses

    import sentencepiece
    import train_tiny
    from decode import Engine, Sampling
    sp, other = (sentencepiece.SentencePieceProcessor(model_file=str(trained_pair / name / "tokenizer.model"))
                 for name in ("target", "draft_othertok"))
    text = (ROOT / "model.py").read_text()
    stream = train_tiny.token_stream(sp, [(None, text[:3000]), (None, text[3000:6000])])
    preset = dataclasses.replace(train_tiny.PRESETS["test"], imitate_rows=5, imitate_tokens=9)
    target = train_tiny.load_checkpoint(trained_pair / "target", torch.device("cpu"))
    rows = train_tiny.target_continuations(target, stream, preset, torch.device("cpu"), seed=7)
    P = preset.prompt_len
    assert len(rows) == 5 and all(len(row) == P + 9 for row in rows)
    assert rows == train_tiny.target_continuations(target, stream, preset, torch.device("cpu"), seed=7)
    windows = {tuple(stream[s:s + P].tolist()) for s in range(len(stream) - P + 1)}
    assert all(tuple(row[:P]) in windows for row in rows)
    for row in rows[::2]:
        alone, _ = generation.generate(Engine(target), torch.tensor(row[:P]), 9, Sampling(0.0), [], stop_at_eos=False)
        assert alone[0] == row[P:]
    assert any(row[P:] != generation.generate(Engine(target), torch.tensor(row[:P]), 9, Sampling(0.0), [],
                                            stop_at_eos=False)[0][0] for row in rows[1::2])
    a, b = sp.encode("x = 12345\n"), sp.encode("  return 'naïve'")
    converted = train_tiny.retokenize([a + [train_tiny.BOS_ID] + b, b], sp, other).tolist()
    assert converted == (other.encode("x = 12345\n") + [train_tiny.BOS_ID] + other.encode("  return 'naïve'")
                         + [train_tiny.EOS_ID] + other.encode("  return 'naïve'") + [train_tiny.EOS_ID])
    assert other.encode("x = 12345\n") != a


def test_checkpoints_load_in_generate(trained_pair):
    stats = cli.main(["--checkpoint_path", str(trained_pair / "target/model.pth"), "--draft_checkpoint_path",
                           str(trained_pair / "draft/model.pth"), "--prompt", "import os\n", "--temperature", "0",
                           "--max_new_tokens", "12", "--num_samples", "1", "--speculate_k", "3"])
    assert len(stats["samples"][0]["tokens"]) <= 12 and stats["speculative"] == "draft"


SHORT = dict(target_steps=8, draft_steps=8, eval_windows=2, prompts=2,
             new_tokens=4, imitate_rows=4, imitate_tokens=8)  # a few steps of every stage
SHORT_RUN = """
import dataclasses, sys
import train_tiny
train_tiny.PRESETS["test"] = dataclasses.replace(train_tiny.PRESETS["test"], **{changes!r})
train_tiny.main(["--preset", "test", "--out_dir", sys.argv[1], "--seed", "0"])
"""


def test_deterministic_with_seed(tmp_path, monkeypatch):
    """Two runs with one seed, here and in another process (its own hash seed), write the same weights bit for bit:
    the test preset cut to a few steps of every stage (the tokenizer, both phases of each training, the imitation
    data, the evaluation) rather than the trained pair's whole run again."""
    import dataclasses
    import subprocess
    import sys
    import train_tiny  # importable: scripts/ is on the path (pytest.ini)
    monkeypatch.setitem(train_tiny.PRESETS, "test", dataclasses.replace(train_tiny.PRESETS["test"], **SHORT))
    train_tiny.main(["--preset", "test", "--out_dir", str(tmp_path / "here"), "--seed", "0"])
    done = subprocess.run([sys.executable, "-c", SHORT_RUN.format(changes=SHORT), str(tmp_path / "there")], cwd=ROOT,
                          capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "scripts"), str(ROOT)])))
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("target", "draft", "draft_othertok"):
        a = torch.load(tmp_path / "here" / name / "model.pth", weights_only=True)
        b = torch.load(tmp_path / "there" / name / "model.pth", weights_only=True)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_text_dir_and_clear_errors(tmp_path):
    import subprocess
    import sys
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "scripts/train_tiny.py"), "--preset", "test", "--text_dir",
                        str(empty), "--out_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode != 0 and "no text files" in r.stderr and "Traceback" not in r.stderr
