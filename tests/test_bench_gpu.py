"""scripts/bench_gpu.py, tried on the CPU at the tiny shape (its GPU runs need a GPU): ours beside transformers on the
same weights and prompt, the greedy answers compared, one line for what the deadline left out."""
import json

import pytest

import bench_gpu
from helpers import write_chatml_tokenizer


@pytest.mark.slow  # a whole-graph compile in generate.py
def test_tiny_shape_on_the_cpu(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "gpu.json"
    write_chatml_tokenizer(work / "tokenizer")  # where the script caches SmolLM2's: nothing is downloaded
    bench_gpu.main(["--device", "cpu", "--runs", "tiny:bf16", "--new_tokens", "6", "--repeats", "1",
                    "--work_dir", str(work), "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["precision"] for r in rows] == ["transformers bf16", "bf16"]
    ours = rows[1]
    assert "error" not in ours and ours["tokens_per_sec"] > 0 and ours["compile_mode"] == "whole"
    assert ours["x_transformers"] == pytest.approx(ours["tokens_per_sec"] / rows[0]["tokens_per_sec"])
    assert len(ours["ids"]) == len(rows[0]["ids"]) == 6 and 0 <= ours["tokens_agree"] <= 6
    bench_gpu.main(["--device", "cpu", "--runs", "tiny:int8", "--seconds", "0", "--work_dir", str(work)])
    assert "tiny int8: skipped (past --seconds)" in capsys.readouterr().out


def test_unknown_runs_are_one_line(capsys):
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--runs", "2b:bf16,1b:fp8"])
    assert "unknown 2b:bf16, 1b:fp8" in capsys.readouterr().err
