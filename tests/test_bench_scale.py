"""scripts/bench_scale.py: its shapes are the real models' bodies, it says in one line what this machine cannot hold,
and at the tiny shape it runs end to end (no llama.cpp here): files converted, stored graphs built and timed, logits
checked against transformers, one process's RSS holding the graphs of two batch sizes and cache lengths, the
table's fields in the JSON and a chart beside it."""
import json
import subprocess
import sys

import pytest

import bench_scale
from errors import UserError
from helpers import ROOT, write_chatml_tokenizer
from model import ModelArgs


@pytest.mark.parametrize("shape, known", [("1b", "Llama-3.2-1B"), ("8b", "Llama-3.1-8B")])
def test_shapes_are_the_llama_bodies_with_smollm2s_vocabulary(shape, known):
    fields, _ = bench_scale.SHAPES[shape]
    ours = ModelArgs.from_hf_config(dict(bench_scale.COMMON, **fields, model_type="llama"))
    theirs = ModelArgs.from_name(known)
    body = ["n_layer", "n_head", "n_local_heads", "dim", "intermediate_size", "head_dim", "rope_base", "block_size",
            "rope_scaling", "tie_word_embeddings"]
    assert {k: getattr(ours, k) for k in body} == {k: getattr(theirs, k) for k in body}
    assert ours.vocab_size == 49152


def test_what_does_not_fit_is_skipped_with_one_line_each(tmp_path, monkeypatch, capsys):
    """On a 24 GiB machine the 8B shape's fp32 weights do not fit in memory, and with 10 GB of disk free the rest of
    it does not fit on disk: one line each, then one error, before anything is built."""
    monkeypatch.setattr(bench_scale, "machine_memory", lambda: 24 * 2**30)
    monkeypatch.setattr(bench_scale.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 10e9})())
    monkeypatch.setattr(bench_scale, "tokenizer_files", lambda work_dir: work_dir / "tokenizer")
    with pytest.raises(UserError, match="no shape could run here"):
        bench_scale.main(["--shapes", "8b", "--work_dir", str(tmp_path / "work")])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("8b: skipped fp32: about 29.") and "memory" in line for line in lines), lines
    [disk] = [line for line in lines if "of disk" in line]
    assert disk.startswith("8b: skipped: needs about ") and "10 GB free" in disk
    assert not (tmp_path / "work" / "8b").exists()


def test_clean_removes_only_what_it_made(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(UserError, match="was not made by bench_scale.py"):
        bench_scale.main(["--clean", "--work_dir", str(other)])
    assert other.is_dir()
    made = tmp_path / "made"
    (made / "tiny" / "ours-fp32" / "compiled").mkdir(parents=True)
    (made / bench_scale.MARKER).touch()
    bench_scale.main(["--clean", "--work_dir", str(made)])
    assert not made.exists() and "removing" in capsys.readouterr().out


@pytest.mark.slow
def test_tiny_shape_end_to_end_without_llama_cpp(tmp_path):
    out, work = tmp_path / "scale.json", tmp_path / "work"
    # a SmolLM2-like tokenizer made here, where the script caches SmolLM2's: nothing is downloaded at test time
    write_chatml_tokenizer(work / "tokenizer")
    done = subprocess.run([sys.executable, "scripts/bench_scale.py", "--shapes", "tiny", "--only", "fp32",
                           "--new_tokens", "8", "--repeats", "1", "--work_dir", str(work), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no --llama_cpp: the llama.cpp columns are skipped" in done.stdout
    assert "tokens_per_sec" in done.stdout and ": ok; same argmax" in done.stdout, done.stdout
    result = json.loads(out.read_text())["shapes"]["tiny"]
    rows = {row["precision"]: row for row in result["rows"]}
    assert list(rows) == ["fp32"] and result["ratios"] == []
    files = {"fp32": work / "tiny/ours-fp32/model.pth"}
    for precision, row in rows.items():
        assert "error" not in row and row["engine"] == "ours" and row["runs"] == 1
        assert row["tokens_per_sec"] > 0 and row["load_s"] > 0 and row["first_build_s"] > 0
        assert 0.05 < row["peak_rss_gb"] < 16 and 0.05 < row["build_rss_gb"] < 16  # the command's own, in GB
        assert row["file_gb"] == pytest.approx(files[precision].stat().st_size / 1e9)
    check = result["logits_check"]
    assert check["passed"] and check["relative"] <= 1e-3 and check["positions"] > 8 and check["top1_agree"] > 0.5
    # one process holding the graphs of batch 1 and 2 at two cache lengths each: its RSS after each, the growth beyond
    # the loaded model and its caches, and the verdict, all from what it measured (the tiny shape's weights are too
    # few for the RSS to tell one copy from two, and the check says so)
    [memory] = result["memory"]
    assert memory["precision"] == "fp32" and "error" not in memory
    assert memory["checkpoint_bytes"] == files["fp32"].stat().st_size
    assert memory["graphs"] == ["b1of1", "b2of2"] and memory["built_while_measured"] == []
    assert memory["mode"] == "stored"
    steps = memory["steps"]
    assert [(step["batch"], step["length"]) for step in steps] == [(1, 256), (1, 1024), (2, 256), (2, 1024)]
    assert steps[0]["caches"] < steps[1]["caches"] and steps[2]["caches"] < steps[3]["caches"]
    assert 0 < memory["rss_before_load"] < memory["rss_loaded"] < 16e9
    for step in steps:
        assert step["growth"] == step["rss"] - memory["rss_loaded"] - step["caches"]
    growth = max(step["growth"] for step in steps)
    assert memory["max_growth"] == growth and memory["x_checkpoint"] == growth / memory["checkpoint_bytes"]
    held = max(step["rss"] - memory["rss_before_load"] - step["caches"] for step in steps)
    assert memory["max_held"] == held and memory["x_held"] == held / memory["checkpoint_bytes"]
    assert memory["one_copy"] == (growth < memory["threshold"] * memory["checkpoint_bytes"]
                                  and held < memory["held_threshold"] * memory["checkpoint_bytes"])
    assert memory["checkpoint_bytes"] < bench_scale.RESOLVES and memory["resolves"] is False
    verdict = "one copy of the weights" if memory["one_copy"] else "MORE THAN ONE COPY"
    [line] = [line for line in done.stdout.splitlines() if line.startswith("ours fp32: checkpoint ")]
    assert f"{verdict} (too few weights for the RSS to tell one copy from two)" in line, line
    assert "b2 x 1024" in done.stdout
    stages = [s["stage"] for s in result["stages"]]
    assert stages == ["transformers checkpoint", "convert_hf_checkpoint.py fp32"]
    # embedding (tied output), per layer q and o, k and v (2 of 4 heads), the MLP, two norms; the final norm
    assert result["params"] == 64 * 49152 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 256 + 2 * 64) + 64
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (work / "tiny/ours-fp32/compiled").is_dir() and not (work / "tiny/inductor-cache").exists()

    bench_scale.main(["--clean", "--work_dir", str(work)])  # what the run made, removed (no new interpreter)
    assert not work.exists()
