"""speculate.py through generate.py: speculative decoding with a draft model.

Greedy output is token-identical to plain greedy decoding for every draft and depth, stops exactly where
plain decoding stops, the acceptance statistics add up, user errors are refused with a message, and at
temperature > 0 the tokens are distributed exactly as the target's (a chi-square test against the
target's distribution computed by enumeration, which deliberately broken rejection rules fail).
"""
import json
import math

import pytest
import torch

import draftmodel
import speculate
from decode import Sampling, logits_to_probs, sample_from
from errors import UserError
from helpers import (DRAWS, PROMPTS, REJECT_BELOW, cli, copy_checkpoint, lossless_pvalues, plain_greedy, run,
                     speculative, tokens, write_checkpoint)


@pytest.fixture(scope="module")
def near_draft(random_target, tmp_path_factory):
    """A draft close to the target (its weights plus noise): it agrees on some tokens and not on others."""
    return copy_checkpoint(random_target, tmp_path_factory.mktemp("near_draft"), noise=0.1, sharpen=8.0)


def draft_path(name, request):
    if name == "self":
        return request.getfixturevalue("random_target")
    return request.getfixturevalue({"random": "random_draft", "near": "near_draft"}[name])


# ----------------------------------------------------------------------------- greedy: token identity

@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_identical_with_trained_draft(trained_pair, k):
    target, draft = trained_pair / "target/model.pth", trained_pair / "draft/model.pth"
    prompt = "import os\nimport sys\n\n\ndef main("
    got = speculative(target, draft, k, "--ignore_eos", prompt=prompt)
    assert tokens(got) == plain_greedy(target, prompt)[:29]
    assert got["speculative"] == "draft" and got["speculate_k"] == k


@pytest.mark.parametrize("draft,k", [("random", 1), ("random", 4), ("random", 8), ("self", 2), ("self", 7),
                                     *[("near", k) for k in range(1, 9)]])
def test_greedy_identical_to_plain_decoding(random_target, request, draft, k):
    """A random draft (nearly every token rejected), the target itself (every token accepted) and a draft
    near the target (some of each): the output is the target's greedy output, token for token."""
    prompt = PROMPTS[k % 2]
    got = speculative(random_target, draft_path(draft, request), k, "--ignore_eos", prompt=prompt)
    assert tokens(got) == plain_greedy(random_target, prompt)[:29]
    counts = got["accept_counts"]
    if draft == "self":
        assert sum(counts[:k]) == 0  # the target agrees with itself on every drafted token
    if draft == "near" and k >= 3:
        assert sum(counts[:k]) > 0 and sum(counts[1:]) > 0  # the draft is both accepted and rejected


@pytest.mark.parametrize("draft,k", [("self", 8), ("near", 3)])
def test_exactly_max_new_tokens(random_target, request, draft, k):
    """Never more than --max_new_tokens, also when the cap falls inside an accepted run of draft tokens."""
    want = plain_greedy(random_target)
    for n in (1, 2, 3, 9, 10, 11, 20):
        assert tokens(speculative(random_target, draft_path(draft, request), k, "--ignore_eos", n=n)) == want[:n]


def test_stops_right_after_eos(random_target, near_draft, tmp_path):
    """With the EOS id set to the token plain decoding emits at index j, generation stops right after
    index j (inside an accepted run for the self-draft with K=8), exactly as plain decoding does;
    --ignore_eos goes on to --max_new_tokens."""
    want = plain_greedy(random_target)
    firsts = [j for j in range(len(want)) if want[j] not in want[:j]]
    for j in (firsts[0], firsts[3], firsts[9]):
        target = copy_checkpoint(random_target, tmp_path / f"eos{j}", eos_token_id=want[j])
        assert tokens(run(target, n=30)) == want[:j + 1]
        for draft, k in ((target, 8), (near_draft, 3)):
            assert tokens(speculative(target, draft, k, n=30)) == want[:j + 1]
            assert tokens(speculative(target, draft, k, "--ignore_eos", n=30)) == want[:30]


def test_speculate_k_auto(random_target, near_draft, trained_pair):
    trained = (trained_pair / "target/model.pth", trained_pair / "draft/model.pth")
    runs = {}
    for name, (target, draft) in {"near": (random_target, near_draft), "self": (random_target, random_target),
                                  "trained": trained}.items():
        runs[name] = speculative(target, draft, "auto", "--ignore_eos", n=30)
        assert tokens(runs[name]) == plain_greedy(target)[:30] and runs[name]["speculate_k"] == 8
    # the depth grows while every drafted token is accepted
    assert max(i for i, c in enumerate(runs["self"]["accept_counts"]) if c) > 2


@pytest.mark.slow
def test_compiled_greedy_identical(random_target, near_draft):
    torch._dynamo.reset()
    got = speculative(random_target, near_draft, 3, "--ignore_eos", "--compile", "whole", n=12)
    assert got["compile"] is True and got["compile_seconds"] > 0
    assert tokens(got) == plain_greedy(random_target)[:12]


# ----------------------------------------------------------------------------- statistics

def test_stats_add_up(random_target, near_draft, tmp_path):
    k, n = 4, 30
    path = tmp_path / "stats.json"
    returned = speculative(random_target, near_draft, k, "--ignore_eos", "--stats_json", path, n=n)
    stats = json.loads(path.read_text())
    assert stats == json.loads(json.dumps(returned))
    counts = stats["accept_counts"]  # counts[i]: verify steps that accepted i draft tokens
    steps, accepted = sum(counts), sum(i * c for i, c in enumerate(counts))
    assert len(counts) == k + 1 and stats["speculate_k"] == k and stats["tree_nodes"] == k
    assert stats["speculative"] == "draft"
    assert steps == stats["target_forwards"] - 1  # one target forward per step, plus the prefill
    assert stats["draft_forwards"] == 1 + k * steps  # the draft's prefill, then K forwards per step
    assert math.isclose(stats["mean_accepted"], accepted / steps)
    assert math.isclose(stats["acceptance_rate"], accepted / (k * steps))
    assert math.isclose(stats["tokens_per_target_forward"], (accepted + steps) / steps)
    # the prefill's token, then each step's accepted tokens and one from the target; the last step's
    # surplus beyond --max_new_tokens is dropped (at most K tokens)
    assert len(tokens(stats)) == n and 0 <= 1 + accepted + steps - n <= k
    assert 0 < accepted < k * steps
    assert stats["tokens_per_sec"] > 0 and stats["samples"][0]["tokens_per_sec"] > 0

    itself = speculative(random_target, random_target, k, "--ignore_eos", n=n)
    steps = math.ceil((n - 1) / (k + 1))  # every step accepts all K and adds the target's token
    assert itself["accept_counts"] == [0] * k + [steps] and itself["target_forwards"] == steps + 1
    assert itself["mean_accepted"] == k and itself["acceptance_rate"] == 1.0


# ----------------------------------------------------------------------------- errors

def error_of(*argv):
    with pytest.raises(UserError) as info:
        cli.main([*map(str, argv)])
    return str(info.value)


def test_clear_errors(random_target, random_draft, tmp_path, tokenizer_model):
    spec = ["--checkpoint_path", random_target, "--draft_checkpoint_path", random_draft]
    small = write_checkpoint(tmp_path / "small_vocab", tokenizer_model, seed=2, dim=32, n_layer=1, n_head=2,
                             vocab_size=256, block_size=256)
    message = error_of("--checkpoint_path", random_target, "--draft_checkpoint_path", small)
    assert "tokenizer" in message and "same model family" in message
    for k in ("0", "-2", "abc", "2.5", ""):
        assert "--speculate_k" in error_of(*spec, "--speculate_k", k)
    assert "--temperature" in error_of(*spec, "--temperature", "-0.5")
    assert "--tree_nodes" in error_of(*spec, "--speculate_k", "4", "--tree_nodes", "3")
    assert "--tree_nodes needs a draft" in error_of("--checkpoint_path", random_target, "--tree_nodes", "8")
    assert "--speculate_k auto needs a draft" in error_of("--checkpoint_path", random_target, "--speculate_k", "auto")
    assert "--draft_ngram" in error_of(*spec, "--draft_ngram", "3")
    assert "N >= 2" in error_of("--checkpoint_path", random_target, "--draft_ngram", "1")
    assert "--tree_nodes must be an integer or 'auto'" in error_of(*spec, "--tree_nodes", "many")
    assert "--tree_nodes auto sizes the trees of a draft head" in error_of(*spec, "--tree_nodes", "auto")


# ----------------------------------------------------------------------------- sampling is lossless
#
# Speculative sampling must leave the output distributed exactly as the target's (Leviathan et al. 2023,
# Chen et al. 2023). The test: a fixed prefix, the real speculative loop (speculate.Speculator.generate with a
# draftmodel.ModelDrafter, depth 2) run DRAWS times for the next two tokens (250 rows of a batch at a time, each
# row an independent draw), and Pearson's chi-square test of
# the first token, the second token and the pair against the target's distribution computed by
# enumeration. The same test run with a deliberately wrong rejection rule must reject it.

def residual_ignores_draft(p, q, x):
    """Broken: after a rejection, sample the target's p again instead of norm(max(0, p - q))."""
    return p / p.sum()


def broken_chain(draw, handed):
    """A draft_chain (the chain's K draft steps) whose token at each step is draw(logits, sampling) and whose
    proposal handed to verify() is handed(logits, sampling)."""
    def chain(model, x, input_pos, sampling, depth):
        tokens, probs = [], []
        for _ in range(depth):
            logits = model(x, input_pos)[:, -1]  # [B, V]
            tokens.append(draw(logits, sampling))
            probs.append(handed(logits, sampling))
            x, input_pos = tokens[-1].view(-1, 1), input_pos[:, -1:] + 1  # [B, 1] each
        return torch.stack(tokens, 1), torch.stack(probs, 1)
    return chain


# Broken: the draft samples from its top-k / top-p distribution, but verify() is handed the distribution before
# top-k / top-p
chain_with_unfiltered_q = broken_chain(lambda logits, s: sample_from(logits_to_probs(logits, s)),
                                       lambda logits, s: logits_to_probs(logits, Sampling(s.temperature)))
# Broken: the draft proposes its argmax, but verify() is told it was sampled from q
greedy_chain_with_soft_q = broken_chain(lambda logits, s: logits.argmax(-1), logits_to_probs)


T1, T07_TOPK_TOPP, T1_TOPK = Sampling(1.0), Sampling(0.7, top_k=5, top_p=0.9), Sampling(1.0, top_k=4)
LOSSLESS_CASES = {  # name: (sampling, what to break or None)
    "temperature 1": (T1, None),
    "temperature 0.7, top-k, top-p": (T07_TOPK_TOPP, None),
    "temperature 1, top-k": (T1_TOPK, None),
    "broken: residual ignores the draft": (T1, ("residual", residual_ignores_draft)),
    "broken: ratio with the unfiltered draft": (T1_TOPK, ("draft_chain", chain_with_unfiltered_q)),
    "broken: greedy draft, sampled q": (T1, ("draft_chain", greedy_chain_with_soft_q)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", LOSSLESS_CASES)
def test_sampling_is_lossless(case, monkeypatch):
    sampling, breakage = LOSSLESS_CASES[case]
    if breakage is not None:
        name, broken = breakage
        monkeypatch.setattr(draftmodel if name == "draft_chain" else speculate, name, broken)  # read when made
    pvalues, accept_counts = lossless_pvalues(2, sampling)
    if breakage is None:
        assert min(pvalues.values()) > REJECT_BELOW, pvalues
        assert accept_counts[0] > 0.1 * DRAWS and accept_counts[2] > 0.1 * DRAWS  # rejections and full accepts
    else:
        assert min(pvalues.values()) < REJECT_BELOW, pvalues


@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "broken: residual ignores the draft"])
def test_small_chi_square_separates_lossless_from_broken(broken, monkeypatch):
    """The quick loop's chi-square: fewer draws, the same verdicts (the full tables above are marked slow)."""
    if broken:
        monkeypatch.setattr(speculate, "residual", residual_ignores_draft)
    pvalues, _ = lossless_pvalues(2, T1, draws=SMALL_DRAWS)
    assert (min(pvalues.values()) < REJECT_BELOW) == broken, pvalues


SMALL_DRAWS = 3_000
