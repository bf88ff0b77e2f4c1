"""tp.py: tensor parallelism over 2 CPU processes (gloo, launched by torchrun) gives the tokens of one process.

tests/tp_worker.py runs under torchrun: every rank compares its sharded logits with the unsharded model's
and runs cli.main(), and writes what it got, so that the tests can compare the ranks with each other
and with one process.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import cli, copy_checkpoint, write_checkpoint, ROOT

pytestmark = pytest.mark.slow  # torchrun / training: minutes

PROMPT = "def main(): return main() if main else main(main(main("


def torchrun(*args, check=True, stdin=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *map(str, args)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, input=stdin)
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def argv_for(checkpoint, *extra, n=16):
    return ["--checkpoint_path", str(checkpoint), "--prompt", PROMPT, "--max_new_tokens", str(n),
            "--num_samples", "1", "--ignore_eos", "--device", "cpu", *map(str, extra)]  # a later --num_samples wins


def single_process(checkpoint, *extra, n=16) -> dict:
    return cli.main(argv_for(checkpoint, *extra, n=n))


def tensor_parallel(tmp_path, checkpoint, *extra, n=16):
    """generate.py under torchrun with 2 ranks: (the stats JSON rank 0 wrote, stdout)."""
    stats = tmp_path / "tp_stats.json"
    result = torchrun("generate.py", *argv_for(checkpoint, *extra, "--stats_json", stats, n=n))
    return json.loads(stats.read_text()), result.stdout


def tokens(stats: dict) -> list:
    return [sample["tokens"] for sample in stats["samples"]]


def chain(draft):
    return ["--draft_checkpoint_path", draft, "--speculate_k", 3]


def tree(draft):
    return ["--draft_checkpoint_path", draft, "--speculate_k", 3, "--tree_nodes", 6]


SAMPLED = ["--temperature", 0.8, "--top_k", 50, "--seed", 7]


@pytest.fixture(scope="module")
def close_draft(tmp_path_factory, random_target) -> Path:
    """The target's weights plus noise: a draft that agrees with the target often but not always, so
    verification accepts anything from 0 to K tokens and the KV caches get compacted."""
    return copy_checkpoint(random_target, tmp_path_factory.mktemp("close_draft"), noise=0.2, seed=5)


@pytest.fixture(scope="module")
def odd_vocab_target(tmp_path_factory, tokenizer_model) -> Path:
    """Vocabulary of 515 rows: 2 ranks cannot split it, so the output layer stays replicated."""
    return write_checkpoint(tmp_path_factory.mktemp("odd_vocab"), tokenizer_model, seed=2, dim=64, n_layer=2,
                            n_head=4, n_local_heads=2, vocab_size=515, block_size=256)


@pytest.fixture(scope="module")
def quantized_targets(tmp_path_factory, random_target) -> dict:
    """The target quantized by quantize.py: {"int8": path, "int4": path}."""
    import quantize
    directory = tmp_path_factory.mktemp("quantized")
    for name in ("config.json", "tokenizer.model", "model.pth"):
        (directory / name).write_bytes((random_target.parent / name).read_bytes())
    # int4 groups of 32 inputs: each rank's slice of wo (32 inputs) and w2 (128) holds whole groups
    return {"int8": quantize.main(["--checkpoint_path", str(directory / "model.pth"), "--mode", "int8"]),
            "int4": quantize.main(["--checkpoint_path", str(directory / "model.pth"), "--mode", "int4",
                                   "--groupsize", "32"])}


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory, random_target, close_draft, odd_vocab_target, quantized_targets):
    """One torchrun launch of 2 ranks (tests/tp_worker.py): the logits of both targets, and
    cli.main() runs; what each rank got."""
    out = tmp_path_factory.mktemp("tp_worker")
    runs = {"sampled_chain": argv_for(random_target, *SAMPLED, *chain(close_draft)),
            "sampled_tree": argv_for(random_target, *SAMPLED, *tree(close_draft)),
            # n-gram drafts come from earlier samples too: the second sample repeats the first one
            "greedy_ngram": argv_for(random_target, "--temperature", 0, "--draft_ngram", 2, "--speculate_k", 3,
                                "--tree_nodes", 4, "--num_samples", 2)}
    runs["greedy_int4"] = argv_for(quantized_targets["int4"], "--temperature", 0, *chain(close_draft))
    runs["greedy_int8"] = argv_for(quantized_targets["int8"], "--temperature", 0, *chain(close_draft))
    runs["greedy_chain"] = argv_for(random_target, "--temperature", 0, *chain(close_draft))
    runs["greedy_tree"] = argv_for(random_target, "--temperature", 0, *tree(close_draft))
    torchrun(ROOT / "tests/tp_worker.py", out, json.dumps([str(random_target), str(odd_vocab_target)]),
             json.dumps(runs))
    return runs, [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_logits_equal_single_process(worker_runs, random_target, odd_vocab_target):
    _, ranks = worker_runs
    for checkpoint, vocab in ((random_target, 512), (odd_vocab_target, 515)):
        mine, other = ranks[0]["logits"][str(checkpoint)], ranks[1]["logits"][str(checkpoint)]
        # prefill of 2 rows x 7 tokens, then 3 one-token decode steps through the KV cache
        assert len(mine["tp"]) == 4 and mine["tp"][0].shape == (2, 7, vocab)
        for got, want, twin in zip(mine["tp"], mine["single"], other["tp"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            assert torch.equal(got, twin)  # every rank holds the same bits: the ranks cannot diverge
        # each rank keeps 2 of the 4 query heads and 1 of the 2 KV heads (in its cache too); the output
        # layer is split only when 2 divides the vocabulary
        assert mine["q_heads"] == 2 and mine["kv_heads"] == 1
        assert mine["output_rows"] == (vocab // 2 if vocab % 2 == 0 else vocab)


def test_sampled_speculative_tokens_agree_across_ranks(worker_runs, random_target):
    """temperature > 0: the ranks draw the same random numbers (shared seed) when sampling, in the draft
    and in the rejection rule, so they keep the same tokens without ever exchanging them."""
    runs, ranks = worker_runs
    greedy = tokens(single_process(random_target, "--temperature", 0))
    for name in ("sampled_chain", "sampled_tree"):
        got, twin = ranks[0]["runs"][name], ranks[1]["runs"][name]
        assert got["world_size"] == 2 and got["speculative"] in ("draft", "tree")
        assert tokens(got) == tokens(twin) and got["accept_counts"] == twin["accept_counts"]
        assert tokens(got) != greedy  # really sampled
        assert sum(got["accept_counts"][1:]) > 0 and sum(got["accept_counts"][:-1]) > 0  # accepts and rejects
        assert tokens(got) == tokens(cli.main(runs[name]))  # and the stream one process samples


def test_ngram_drafting_tokens_equal_single_process(worker_runs):
    runs, ranks = worker_runs
    want = cli.main(runs["greedy_ngram"])
    assert sum(want["accept_counts"][1:]) > 0
    for rank in ranks:
        got = rank["runs"]["greedy_ngram"]
        assert got["speculative"] == "ngram" and got["world_size"] == 2
        assert tokens(got) == tokens(want) and got["accept_counts"] == want["accept_counts"]


def test_int4_tokens_equal_single_process(worker_runs):
    runs, ranks = worker_runs
    want = cli.main(runs["greedy_int4"])
    for rank in ranks:
        got = rank["runs"]["greedy_int4"]
        assert got["quantization"] == want["quantization"] == "int4"
        assert tokens(got) == tokens(want) and got["accept_counts"] == want["accept_counts"]


def test_greedy_cli_tokens_equal_single_process(random_target, tmp_path):
    """generate.py itself under torchrun: one process's tokens, and only rank 0 prints (the same `say` in every
    mode: the speculative modes run in the worker's launch, below)."""
    want = single_process(random_target, "--temperature", 0)
    got, stdout = tensor_parallel(tmp_path, random_target, "--temperature", 0)
    assert tokens(got) == tokens(want)
    assert got["world_size"] == 2 and want["world_size"] == 1 and got["speculative"] == want["speculative"]
    assert stdout.count("Loaded ") == 1 and stdout.count("Sample 1:") == 1  # only rank 0 prints


@pytest.mark.parametrize("name", ["greedy_chain", "greedy_tree", "greedy_int8"])
def test_greedy_speculative_tokens_equal_single_process(worker_runs, name):
    """A draft's chain and tree on the float target, a chain on the int8 one: the tokens, accepts and target
    forwards of one process, on every rank."""
    runs, ranks = worker_runs
    want = cli.main(runs[name])
    assert sum(want["accept_counts"][1:]) > 0
    for rank in ranks:
        got = rank["runs"][name]
        assert got["world_size"] == 2 and want["world_size"] == 1
        assert got["speculative"] == want["speculative"] and got["quantization"] == want["quantization"]
        assert tokens(got) == tokens(want)
        assert got["accept_counts"] == want["accept_counts"] and got["target_forwards"] == want["target_forwards"]
    assert want["quantization"] == ("int8" if name == "greedy_int8" else "none")


def test_compiled_tensor_parallel_equals_eager_single_process(tokenizer_model, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "one_layer", tokenizer_model, seed=3, dim=64, n_layer=1, n_head=4,
                                  n_local_heads=2, vocab_size=512, block_size=64)
    want = single_process(checkpoint, "--temperature", 0, n=6)
    got, _ = tensor_parallel(tmp_path, checkpoint, "--temperature", 0, "--compile", "whole", n=6)
    assert got["compile"] is True and got["compile_seconds"] > 0
    assert tokens(got) == tokens(want)


def test_interactive_rank_0_reads_and_every_rank_answers(random_target):
    result = torchrun("generate.py", "--checkpoint_path", random_target, "--interactive", "--max_new_tokens", 5,
                      "--temperature", 0, "--device", "cpu", stdin="Hello\nWhat next?\n")
    # rank 0 asks 3 times (the third question meets the end of the input); the others ask nothing
    assert result.stdout.count("What is your prompt?") == 3
    assert "Sample 2:" in result.stdout and "Sample 3:" not in result.stdout


def test_world_size_that_does_not_split_the_heads_is_refused(tokenizer_model, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "three_kv_heads", tokenizer_model, dim=48, n_layer=1, n_head=6,
                                  n_local_heads=3, intermediate_size=96, vocab_size=512, block_size=64)
    result = torchrun("generate.py", *argv_for(checkpoint, n=4), check=False)
    assert result.returncode != 0 and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    # one line per rank (torchrun may stop the other rank before it prints it), no traceback of ours
    assert 1 <= len(errors) <= 2, result.stderr
    for line in errors:
        assert line == ("error: tensor parallelism over 2 ranks needs n_kv_heads=3 to be a multiple of 2: launch "
                        "torchrun with a total of N ranks (--nproc_per_node x --nnodes), N in [3]")
    assert "UserError" not in result.stderr and 'generate.py", line' not in result.stderr
