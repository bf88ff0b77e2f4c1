"""Speculative decoding for a batch of different prompts (speculate.Speculator.generate at B > 1): every row
keeps its own cache length, acceptance and stop, and equals its prompt decoded alone."""
import json

import pytest
import torch

import decode
import generation
import speculate
from helpers import cli, copy_checkpoint, lossless_pvalues, DRAWS, PREFIX, PREFIX2, REJECT_BELOW

# different lengths; the second repeats itself, so an n-gram lookup finds continuations
BATCH = ([1, 5, 9], [1, 7, 3, 3, 8, 20, 11, 4, 7, 3, 3, 8, 20], [1, 30, 31, 32, 33, 34], [1, 250])
SHIFTED = ([1, 5], [1, 7, 3, 3, 8, 20, 11, 4], [1, 30, 31, 32, 33, 34, 35, 36], [1, 250, 7, 7, 7])  # other lengths
KINDS = {  # name: (draft, speculate_k, tree_nodes, n-gram n)
    "chain": ("near", 3, None, 0),
    "tree": ("near", 3, 8, 0),
    "n-gram": (None, 4, 8, 3),
    "tree with merged n-gram": ("near", 3, 8, 2),
}


@pytest.fixture(scope="module")
def near_draft(random_target, tmp_path_factory):
    """A draft close to the target (its weights plus noise): it agrees on some tokens and not on others."""
    return copy_checkpoint(random_target, tmp_path_factory.mktemp("batched_near"), noise=0.1, sharpen=8.0)


def alone(engine, prompts, n, eos=()):
    """Each prompt's own plain greedy continuation, decoded by itself."""
    rows = [generation.generate(engine, torch.tensor(p), n, decode.Sampling(), [], stop_at_eos=False)[0][0]
            for p in prompts]
    return [generation.truncate_at_eos(row, set(eos)) for row in rows]


def check_rows(engine, eager, drafter):
    """Four prompts of different lengths, speculated together (greedy): each row equals the prompt's own plain
    greedy continuation, one row stopping early at EOS; then batches of other lengths. Returns the number of
    compiled graphs before the last batch and after it."""
    from torch._dynamo.utils import counters
    want = alone(eager, BATCH, 20)
    eos = want[2][4]  # row 2 meets this token early (others may too: then they stop there as well)
    want = [generation.truncate_at_eos(row, {eos}) for row in want]
    got, stats = generation.generate(engine, [list(p) for p in BATCH], 20, decode.Sampling(), [eos], speculator=drafter)
    assert got == want and len(got[2]) <= 5
    assert sum(i * c for i, c in enumerate(stats["accept_counts"])) > 0  # drafts were accepted
    for _ in range(2):  # the second batch meets shapes the first may not have (a row with a token pending, or none)
        got, _ = generation.generate(engine, [list(p) for p in SHIFTED], 20, decode.Sampling(), [], stop_at_eos=False,
                                   speculator=drafter)
        assert got == alone(eager, SHIFTED, 20)
    graphs = counters["stats"]["unique_graphs"]
    got, _ = generation.generate(engine, [list(p) for p in reversed(BATCH)], 20, decode.Sampling(), [],
                               stop_at_eos=False, speculator=drafter)
    assert got == alone(eager, list(reversed(BATCH)), 20)
    return graphs, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("kind", KINDS)
def test_rows_equal_each_prompt_alone(random_target, near_draft, kind):
    draft_name, k, nodes, ngram = KINDS[kind]
    model = generation.load_model(random_target)
    draft = generation.load_model(near_draft) if draft_name else None
    eager = decode.Engine(model)
    draft_engine = decode.Engine(draft) if draft_name else None
    check_rows(eager, eager, generation.make_speculator(generation.Speculation(k, nodes, ngram), draft_engine,
                                                        model.args.block_size))


@pytest.mark.slow
def test_compiled_rows_equal_each_prompt_alone_without_recompiling(random_target, near_draft):
    """check_rows() for every kind on compiled graphs (one compiled target; the kinds verify 4 or 9 tokens per
    row): after warm-up, batches of other prompt lengths compile nothing new. Regional graphs: static shapes like
    whole ones, at a fraction of the cold compile (test_generate checks batched rows on whole graphs)."""
    model, draft = generation.load_model(random_target), generation.load_model(near_draft)
    eager = decode.Engine(model)
    torch._dynamo.reset()
    engine = decode.compile_engine(model, "cpu", "regional", compile_prefill=True)
    model.setup_caches(len(BATCH), model.args.block_size)  # once for every kind, as generate.main does for a run
    for kind, (draft_name, k, nodes, ngram) in KINDS.items():
        draft_engine = decode.compile_engine(draft, "cpu", "regional") if draft_name else None
        speculation = generation.Speculation(k, nodes, ngram)
        drafter = generation.make_speculator(speculation, draft_engine, model.args.block_size)
        before, after = check_rows(engine, eager, drafter)
        assert after == before, f"{kind}: {after - before} graphs compiled after warm-up"


def test_speculate_k_auto_falls_back_to_plain_when_speculation_is_slower(random_target, near_draft, monkeypatch):
    """--speculate_k auto times a plain step against its first speculative steps and decodes plainly when
    speculation measured slower; either way each row equals its prompt alone."""
    model, draft = generation.load_model(random_target), generation.load_model(near_draft)
    engine = decode.Engine(model)
    want = alone(engine, BATCH, 30)
    for plain_step, switched in ((1e-9, True), (1e9, False)):  # plain decoding made to look faster, then slower
        monkeypatch.setattr(speculate, "plain_step_seconds", lambda *a: plain_step)
        speculation = generation.Speculation("auto")
        drafter = generation.make_speculator(speculation, decode.Engine(draft), model.args.block_size)
        got, stats = generation.generate(engine, [list(p) for p in BATCH], 30, decode.Sampling(), [],
                                       stop_at_eos=False, speculator=drafter)
        assert got == want
        assert ("plain_after_forwards" in stats) == switched
        if switched:  # the prefill and the timed speculative steps, then plain forwards for the rest
            assert stats["plain_after_forwards"] == 1 + speculate.AUTO_PROBE_STEPS + 1
            assert stats["target_forwards"] > stats["plain_after_forwards"] + 5
        # the next generation at this batch size goes straight to the choice made
        got, stats = generation.generate(engine, [list(p) for p in BATCH], 30, decode.Sampling(), [],
                                       stop_at_eos=False, speculator=drafter)
        assert got == want
        assert stats.get("plain_after_forwards") == (1 if switched else None)


def test_prompts_file_with_a_draft(random_target, near_draft, tmp_path):
    """--prompts_file with --batch_size and a draft: the rows in --stats_json equal each prompt run alone."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main(\nHello, my name is\nx = [1, 2\n")
    out = tmp_path / "stats.json"
    cli.main(["--checkpoint_path", str(random_target), "--prompts_file", str(prompts), "--batch_size", "3",
                   "--draft_checkpoint_path", str(near_draft), "--speculate_k", "3", "--max_new_tokens", "12",
                   "--temperature", "0", "--ignore_eos", "--num_samples", "1", "--stats_json", str(out)])
    stats = json.loads(out.read_text())
    assert stats["speculative"] == "draft" and stats["target_forwards"] < 3 * 12
    for row in stats["rows"]:
        single = cli.main(["--checkpoint_path", str(random_target), "--prompt", row["prompt"], "--max_new_tokens",
                                "12", "--temperature", "0", "--ignore_eos", "--num_samples", "1"])
        assert row["tokens"] == single["samples"][0]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("tree_nodes", [2, 6], ids=["chain", "tree"])
def test_sampling_is_lossless_per_row_at_two_positions(tree_nodes):
    """Rows of two prompts of different lengths in one batch (so at different cache positions), sampled at
    T = 0.7 with top-k and top-p: each prompt's draws follow the target's exact distribution (chi-square,
    DRAWS / 2 per prompt; every other lossless test also runs 250-row batches, at one position)."""
    pvalues, accept_counts = lossless_pvalues(tree_nodes, decode.Sampling(0.7, top_k=5, top_p=0.9),
                                              draft=(1.0, 4.0), prompts=(PREFIX, PREFIX2), draws=DRAWS // 2)
    assert min(pvalues.values()) > REJECT_BELOW, pvalues
    assert accept_counts[0] > 0 and sum(accept_counts[1:]) > 0.05 * DRAWS
