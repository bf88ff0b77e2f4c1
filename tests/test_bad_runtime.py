"""Bad input that shows only at run time (issue #38): sizes that would not fit in memory, a chat template that would
run for hours, logits that turn NaN mid-run, torchrun ranks launched with different arguments, Ctrl-C while the
imports run. Each ends in one line `error: ...` naming the flag or file and what to do (exit 1; 130 for Ctrl-C),
never a traceback or a hang.

Most rows run generate.py's command line in this process (cli.cli(argv): run_cli's one line and exit status,
without the ~3 CPU seconds of a new interpreter); the torchrun and Ctrl-C rows need processes of their own.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import generation
from helpers import ROOT, cli


def argv_for(checkpoint, *extra, n=20):
    return ["--checkpoint_path", checkpoint, "--prompt", "def main(", "--max_new_tokens", n, "--num_samples", 1,
            "--temperature", 0, "--device", "cpu", *extra]


def run_cli(capsys, *argv):
    """generate.py's command line in this process: (exit status, stderr lines, seconds)."""
    capsys.readouterr()
    t0 = time.monotonic()
    status = cli.cli([str(a) for a in argv])
    return status, capsys.readouterr().err.strip().splitlines(), time.monotonic() - t0


def assert_one_line(result, *expect, bound=10):
    status, lines, seconds = result
    assert status == 1 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(e in lines[0] for e in map(str, expect)), lines[0]
    assert "Traceback" not in lines[0] and seconds < bound, (lines[0], seconds)


def checkpoint_copy(source: Path, directory: Path, **config) -> Path:
    """A copy of the checkpoint directory of `source` (model.pth) with config.json entries replaced."""
    directory.mkdir()
    for name in ("tokenizer.model", "model.pth"):
        shutil.copy(source.parent / name, directory)
    hf = json.loads((source.parent / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(hf, **config)))
    return directory / "model.pth"


# ----------------------------------------------------------------------------- memory, estimated before allocating

def test_kv_cache_beyond_memory_names_the_flags(random_target, capsys):
    result = run_cli(capsys, *argv_for(random_target, "--batch_size", 10**11))
    assert_one_line(result, "KV cache", "--batch_size", "--max_new_tokens", "available")


def test_weights_beyond_memory_name_the_checkpoint(random_target, capsys, monkeypatch):
    # bf16 on the CPU copies every fp32 weight (fp32 ones would stay memory-mapped from the file)
    monkeypatch.setattr(generation, "available_memory", lambda device: 4096)
    result = run_cli(capsys, *argv_for(random_target, "--precision", "bf16"))
    assert_one_line(result, f"loading {random_target}", "--precision")


def test_rope_table_beyond_memory_names_the_config(random_target, tmp_path, capsys, monkeypatch):
    checkpoint = checkpoint_copy(random_target, tmp_path / "long", max_position_embeddings=2**24)
    monkeypatch.setattr(generation, "available_memory", lambda device: 256 << 20)
    result = run_cli(capsys, *argv_for(checkpoint))
    assert_one_line(result, checkpoint.parent / "config.json", "max_position_embeddings")


# ----------------------------------------------------------------------------- chat templates: loops, output, time

@pytest.mark.parametrize("template, limit", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}", "loops"),
    ("{% for i in range(1000) %}{{ 'x' * 100000 }}{% endfor %}", "writes"),
    ("{{ 'x' * 10 ** 9 }}", "sequence"),
    ("{{ 10 ** 100000000 }}", "power"),
], ids=["nested_ranges", "output", "string_times_n", "power"])
def test_costly_chat_template_fails_fast(template, limit, random_target, tmp_path, capsys):
    checkpoint = checkpoint_copy(random_target, tmp_path / "chat")
    (checkpoint.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    result = run_cli(capsys, *argv_for(checkpoint, "--chat"))
    assert_one_line(result, f"chat template in {checkpoint.parent / 'tokenizer_config.json'}", limit, bound=8)


# ----------------------------------------------------------------------------- NaN logits after the prefill

@pytest.fixture
def nan_after(monkeypatch):
    """nan_after(checkpoint, calls): the target's first block outputs NaN from its call number calls + 1 on (the
    prefill is call 1), as weights that overflow a few tokens into the run would."""
    def poison(checkpoint, calls):
        load = generation.load_model

        def load_poisoned(path, *args, **kwargs):
            model = load(path, *args, **kwargs)
            if Path(path) == Path(checkpoint):
                count = [0]

                def hook(_module, _inputs, out):
                    count[0] += 1
                    return out * float("nan") if count[0] > calls else out
                model.layers[0].register_forward_hook(hook)
            return model
        monkeypatch.setattr(generation, "load_model", load_poisoned)
    return poison


@pytest.mark.parametrize("mode", ["greedy", "sampled", "batched", "chain", "tree", "ngram"])
def test_logits_turning_nan_mid_run_stop_with_one_line(mode, nan_after, random_target, random_draft, capsys):
    draft = ["--draft_checkpoint_path", random_draft, "--speculate_k", 3]
    extra = {"greedy": [], "sampled": ["--temperature", 0.8], "batched": ["--batch_size", 3], "chain": draft,
             "tree": draft + ["--tree_nodes", 6], "ngram": ["--draft_ngram", 2, "--speculate_k", 3]}[mode]
    nan_after(random_target, 3)
    result = run_cli(capsys, *argv_for(random_target, "--ignore_eos", *extra, n=30))
    assert_one_line(result, "NaN", random_target, "--precision")
    assert "for the prompt" not in result[1][0]  # the prefill was fine: caught while decoding


# ----------------------------------------------------------------------------- torchrun ranks that disagree

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_launched_with_different_arguments_fail_every_rank(random_target, tmp_path):
    """Two ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), rank 1 with another
    --max_new_tokens: each exits 1 with the same one line, long before any join timeout."""
    worker = tmp_path / "worker.py"
    worker.write_text(f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nimport generate\n"
                      "extra = ['--max_new_tokens', '3'] if os.environ['RANK'] == '1' else []\n"
                      "sys.exit(generate.cli(sys.argv[1:] + extra))\n")
    port = free_port()
    ranks = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", FASTGEN_DIST_TIMEOUT="30")
        ranks.append(subprocess.Popen([sys.executable, str(worker), *map(str, argv_for(random_target, n=4))],
                                      cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    t0 = time.monotonic()
    results = [(p, *p.communicate(timeout=60)) for p in ranks]
    want = "error: rank 1 was launched with another --max_new_tokens than rank 0 ('3' instead of '4'): give every " \
           "rank the same arguments"
    for p, stdout, stderr in results:
        errors = [line for line in stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
        assert p.returncode == 1 and errors == [want], stderr
        assert "Loaded" not in stdout  # refused before loading
    assert time.monotonic() - t0 < 25


# ----------------------------------------------------------------------------- Ctrl-C while the imports run

def importing_torch(pid: int, seconds: float = 10) -> bool:
    """Wait until the process has started loading torch's libraries (generate.py's imports run)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if "torch" in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:
            return False
        time.sleep(0.005)
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see when torch starts loading")
def test_ctrl_c_while_importing_is_one_line(random_target):
    for _ in range(3):  # the signal must land inside the imports (torch's take a second or more)
        process = subprocess.Popen([sys.executable, "generate.py", *map(str, argv_for(random_target))], cwd=ROOT,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        hit = importing_torch(process.pid)
        if hit:
            process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
        if hit and stdout == "":  # no "Loaded ...": it stopped before the run began
            break
    else:
        pytest.skip("could not send SIGINT while generate.py was importing")
    assert process.returncode == 130 and stderr.strip() == "error: interrupted", stderr
