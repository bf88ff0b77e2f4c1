"""scripts/bench_serve.py beside a peer: its percentiles and times per output token from chunk times, the side-by-side
rows, table and JSON, bad peer flags in one line, and (slow) the whole comparison with our own serve.py standing in
as the peer (CI has no llama.cpp: the peer is any OpenAI-compatible server started by a command line)."""
import itertools
import json
import random
import subprocess
import sys

import numpy as np
import pytest

import bench_serve
from helpers import ROOT


def answer(sent: float, arrivals: list, tokens: int, ended: float, turn: int = None) -> dict:
    result = {"sent": sent, "arrivals": arrivals, "tokens": tokens, "ended": ended}
    return result if turn is None else dict(result, turn=turn)


def test_percentiles_are_numpys_linear_ones():
    rng = random.Random(0)
    for n in (2, 3, 10, 101, 257):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (50, 95):
            assert bench_serve.percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    assert bench_serve.percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert bench_serve.percentile([3.0], 95) == 3.0 and bench_serve.percentile([], 50) is None


def test_first_token_and_per_token_times_come_from_the_chunk_times():
    """TTFT: request sent -> first chunk; TPOT: an answer's first chunk -> last over its chunks after the first
    (none for an answer of one chunk or none; chunks handed over in bursts count at their mean pace)."""
    results = [answer(0.0, [0.5, 0.6, 0.8], 3, 0.9), answer(1.0, [1.2, 1.25], 2, 1.3), answer(2.0, [], 0, 2.1),
               answer(3.0, [3.1], 1, 3.2), answer(4.0, [4.1, 4.1, 4.1, 4.4, 4.4, 4.4], 6, 4.5)]
    ttft, tpot = bench_serve.latencies(results)
    assert ttft == pytest.approx([0.5, 0.2, 0.1, 0.1]) and tpot == pytest.approx([0.15, 0.05, 0.06])


def test_summary_counts_the_answers_that_ended_inside_the_window():
    """Tokens/s: tokens of the answers that ended by the window's end over its length; answer tokens/s: the mean of
    each such answer's tokens over sent -> last chunk; latencies over every answer; a chat's last turn apart."""
    done = [answer(0.0, [0.1, 0.2, 0.4], 3, 0.5, turn=1), answer(0.5, [0.9, 1.0], 2, 1.0, turn=2),
            answer(1.0, [1.5, 1.6, 1.9, 2.0], 4, 2.5, turn=2)]  # the last one ends after the window
    row = bench_serve.summarize(done, seconds=2.0, stop_at=2.0)
    assert row["requests"] == 3 and row["tokens_per_sec"] == pytest.approx((3 + 2) / 2.0)
    assert row["answer_tokens_per_sec"] == pytest.approx((3 / 0.5 + 2 / 0.5) / 2) and row["tokens_per_answer"] == 2.5
    assert row["ttft_p50"] == pytest.approx(0.4) and row["ttft_p95"] == pytest.approx(np.percentile([.1, .4, .5], 95))
    paces = [0.15, 0.1, 0.5 / 3]
    assert row["tpot_p50"] == pytest.approx(np.percentile(paces, 50))
    assert row["tpot_p95"] == pytest.approx(np.percentile(paces, 95))
    assert row["last_turn"] == 2 and row["last_turn_ttft_p50"] == pytest.approx(0.45)


def test_side_by_side_rows_print_and_hold_both_sides_and_their_ratios(tmp_path, capsys):
    ours = {"requests": 10, "tokens_per_answer": 30.0, "tokens_per_sec": 300.0, "answer_tokens_per_sec": 40.0, "ttft_p50": 0.02,
            "ttft_p95": 0.05, "tpot_p50": 0.01, "tpot_p95": 0.02, "clients": 4}
    peer = dict(ours, tokens_per_sec=150.0, answer_tokens_per_sec=50.0, ttft_p95=0.1, tpot_p50=None)
    row = bench_serve.side_by_side(4, "plain", "shared", 4, {"ours": ours, "peer": peer})
    assert row["x"]["tokens_per_sec"] == 2.0 and row["x"]["answer_tokens_per_sec"] == 0.8
    assert row["x"]["ttft_p95"] == pytest.approx(2.0) and row["x"]["ttft_p50"] == 1.0
    assert row["x"]["tpot_p50"] is None and row["x"]["last_turn_ttft_p50"] is None
    args = bench_serve.parse(["--llama_cpp", "L", "--json", str(tmp_path / "out.json")])
    bench_serve.report_versus(args, [], {"name": "llama-server", "command": ["x"], "draft": []}, [row])
    lines = capsys.readouterr().out.splitlines()
    assert "TTFT p95" in lines[0] and "ours / peer" in lines[0]
    assert lines[1].split()[:8] == ["4", "plain", "shared", "ours", "4", "10", "30.0", "300.0"]
    assert lines[2].split()[3] == "llama-server" and lines[3].split()[3:6] == ["x", "2.00", "0.80"]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["rows"] == [row] and result["peer"]["name"] == "llama-server" and args.batch_sizes == [1, 2, 4, 8]


@pytest.mark.parametrize("flags, said", [
    (["--llama_cpp", "/nonexistent"], "has no build/bin/llama-server"),
    (["--peer_command", "server --port {port} --ctx {nope}"], "cannot fill in 'nope'"),
    (["--peer_command", "server", "--draft_checkpoint_path", "d.pth"], "need a drafter on both sides"),
    (["--peer_command", "server", "--llama_cpp", "L"], "not both"),
    (["--workloads", "plain,bursty"], "--workloads must name some of"),
    (["--gguf", "m.gguf"], "give --llama_cpp DIR too"),
    (["--peer_command", "server", "--", "--max_seq_length", "512"], "give --context and --batch_sizes"),
])
def test_bad_peer_flags_are_one_line_before_any_server(flags, said):
    with pytest.raises(SystemExit, match=said) as e:
        bench_serve.main(["--checkpoint_path", "m.pth", *flags])
    assert str(e.value).startswith("error: ") and "\n" not in str(e.value)


@pytest.mark.slow
def test_bench_serve_beside_a_peer_started_by_its_command_line(random_target, random_draft, tmp_path):
    """serve.py on the same checkpoint stands in for llama-server: every workload, plain and speculative, measured on
    both through the same clients, side by side with their ratios, printed and in the JSON."""
    out = tmp_path / "versus.json"
    peer = (f"env OMP_NUM_THREADS={{threads}} {sys.executable} serve.py --checkpoint_path {random_target} "
            f"--port {{port}} --max_batch_size {{batch}} --max_seq_length {{context}}")
    done = subprocess.run([sys.executable, "scripts/bench_serve.py", "--checkpoint_path", str(random_target),
                           "--batch_sizes", "2", "--seconds", "1", "--max_tokens", "8", "--context", "256",
                           "--workloads", "plain,shared,chat", "--system_tokens", "40", "--chat_history", "60",
                           "--turns", "2", "--threads", "1", "--draft_checkpoint_path", str(random_draft),
                           "--peer_command", peer, "--peer_draft_flags", f"--draft_checkpoint_path {random_draft}",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [line.split() for line in done.stdout.splitlines()[1:]]
    assert [line[3] for line in printed] == ["ours", "peer", "x"] * 6
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["mode"], r["workload"]) for r in rows] == list(itertools.product(["plain", "speculative"],
                                                                                 ["plain", "shared", "chat"]))
    for r in rows:
        assert r["batch_size"] == 2 and r["clients"] == 2
        for side in ("ours", "peer"):
            f = r[side]
            assert f["requests"] >= 1 and f["tokens_per_sec"] > 0 and 0 < f["ttft_p50"] <= f["ttft_p95"]
            assert 0 < f["tpot_p50"] <= f["tpot_p95"]
            assert (f.get("last_turn"), f.get("last_turn_ttft_p50") is not None) == (
                (2, True) if r["workload"] == "chat" else (None, False))
        assert r["x"]["tokens_per_sec"] == pytest.approx(r["ours"]["tokens_per_sec"] / r["peer"]["tokens_per_sec"])
        assert r["x"]["ttft_p95"] == pytest.approx(r["peer"]["ttft_p95"] / r["ours"]["ttft_p95"])
    assert result["peer"]["command"][-6:] == ["--port", "{port}", "--max_batch_size", "{batch}", "--max_seq_length",
                                              "{context}"]
