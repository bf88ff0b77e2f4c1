"""Token-tree verification (speculate.py, draftmodel.py): one forward over a token tree gives each node the
logits of its own branch; compacting the KV cache after a non-contiguous accepted path leaves the target's and
the draft's caches as if that path had been decoded normally; tree and n-gram drafting give plain greedy
output; and multi-candidate (sibling) verification samples exactly from the target.
"""
import math
import random

import pytest
import torch

import draftmodel
import generation
import decode
import speculate
from decode import Engine, Sampling
from helpers import (DRAWS, PROMPTS, REJECT_BELOW, copy_checkpoint, lossless_pvalues, plain_greedy, run,
                     speculative, tokens)
from model import ModelArgs, Transformer


@pytest.fixture(scope="module")
def near_draft(random_target, tmp_path_factory):
    """A draft close to the target (its weights plus noise), confident enough to grow deep trees."""
    return copy_checkpoint(random_target, tmp_path_factory.mktemp("near_draft"), noise=0.1, sharpen=8.0)


def random_tree(rng: random.Random, nodes: int, pads: int = 0):
    """Parents (root first, every parent before its children, then `pads` padding nodes) and depths;
    a mix of long chains and bushy levels."""
    parents = [-1] + [i - 1 if rng.random() < 0.4 else rng.randrange(i) for i in range(1, nodes)]
    parents += [speculate.NO_PARENT] * pads
    depths = []
    for parent in parents:
        depths.append(depths[parent] + 1 if parent >= 0 else 0)
    return parents, depths


def branch(parents: list, node: int) -> list:
    """The nodes from the root down to `node` (a padding node is a branch of its own)."""
    nodes = [node]
    while parents[nodes[0]] >= 0:
        nodes.insert(0, parents[nodes[0]])
    return nodes


def full_forward(model, ids: list):
    """Logits [len(ids), vocab] of one causal forward over `ids` from position 0 (rewrites the cache from slot 0)."""
    return model(torch.tensor([ids]), torch.arange(len(ids)).view(1, -1))[0]


# ----------------------------------------------------------------------------- tree attention

@pytest.mark.parametrize("kind", ["gqa", "mha"])
@torch.no_grad()
def test_tree_forward_equals_each_branch_alone(kind, random_target):
    """Positions = prefix length + depth, and the mask from speculate.tree_mask: each node's logits equal
    those of its root-to-node branch run alone after the prefix."""
    if kind == "gqa":
        model = generation.load_model(random_target)  # 4 query heads over 2 key/value heads
    else:
        torch.manual_seed(0)
        model = Transformer(ModelArgs(dim=32, n_layer=2, n_head=4, vocab_size=64, block_size=128)).eval()
    assert (model.args.n_local_heads < model.args.n_head) == (kind == "gqa")
    model.setup_caches(1, 64)
    rng = random.Random(0)
    vocab = model.args.vocab_size
    for _ in range(6):
        parents, depths = random_tree(rng, rng.randrange(2, 21), pads=rng.randrange(3))
        n, start = len(parents), rng.randrange(1, 12)
        prefix = [rng.randrange(vocab) for _ in range(start)]
        ids = [rng.randrange(vocab) for _ in range(n)]
        want = torch.stack([full_forward(model, prefix + [ids[i] for i in branch(parents, i)])[-1] for i in range(n)])
        full_forward(model, prefix)
        got = model(torch.tensor([ids]), torch.tensor([[start + d for d in depths]]),
                    torch.arange(start, start + n).view(1, -1),
                    speculate.tree_mask(parents, start, model.max_seq_length, "cpu"))[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- KV-cache compaction

@torch.no_grad()
def test_target_cache_after_compaction_equals_fresh_decoding(random_target):
    """Three rounds of: a tree forward, accept a root-to-node path whose nodes are scattered over the
    tree's slots, move its keys/values to contiguous slots. Then decoding goes on with logits equal to
    those of a fresh model that read the prefix and the accepted paths as one sequence."""
    model, fresh = generation.load_model(random_target), generation.load_model(random_target)
    model.setup_caches(1, 96)
    fresh.setup_caches(1, 96)
    rng = random.Random(1)
    vocab = model.args.vocab_size
    sequence = [rng.randrange(vocab) for _ in range(7)]  # what the cache holds, in order
    full_forward(model, sequence)
    pos, root = len(sequence), rng.randrange(vocab)  # the root sits at slot pos, not yet cached
    for _ in range(3):
        parents, depths = random_tree(rng, 12)
        path = branch(parents, max(range(12), key=lambda i: (depths[i], i)))[1:]
        assert path != list(range(1, len(path) + 1))  # not already contiguous
        ids = [root] + [rng.randrange(vocab) for _ in range(11)]
        model(torch.tensor([ids]), torch.tensor([[pos + d for d in depths]]), torch.arange(pos, pos + 12).view(1, -1),
              speculate.tree_mask(parents, pos, model.max_seq_length, "cpu"))
        decode.move_cache_slots(model, [pos + i for i in path], list(range(pos + 1, pos + 1 + len(path))))
        sequence += [root] + [ids[i] for i in path]
        pos, root = pos + 1 + len(path), rng.randrange(vocab)
    going_on = [root, rng.randrange(vocab), rng.randrange(vocab)]
    got = model(torch.tensor([going_on]), torch.arange(pos, pos + 3).view(1, -1))[0]
    torch.testing.assert_close(got, full_forward(fresh, sequence + going_on)[-3:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("last_node_fed", [True, False])
@torch.no_grad()
def test_draft_cache_after_compaction_equals_fresh_decoding(random_draft, last_node_fed, monkeypatch):
    """The draft grows a tree (4 children per expanded node, so an accepted path's keys/values lie at
    scattered slots); after a path is accepted its cache is compacted, and a last accepted node the draft
    never read is fed with the next root. The next step's draft logits equal a fresh model's on the prefix
    and the accepted path read as one sequence."""
    draft, fresh = generation.load_model(random_draft), generation.load_model(random_draft)
    fresh.setup_caches(1, 64)
    monkeypatch.setattr(draftmodel, "GREEDY_RANK_TEMPERATURE", 0.05)  # a random draft is flat: rank deep nodes high
    speculator = draftmodel.ModelDrafter(Engine(draft), 3, 9)
    speculator.grow_tree = None  # depth by depth on the host (draft_tree grows the same tree: test below)
    assert speculator.width == 4
    prompt = [1, 17, 33, 250, 7, 90]
    speculator.start([prompt], 64)
    calls = []  # (token ids, logits) of every draft forward

    def recorded(x, input_pos, slots, mask, width, last):
        calls.append((x, draft(x, input_pos, slots, mask)))
        return draftmodel.greedy_candidates(calls[-1][1][:, -1] if last else calls[-1][1].flatten(0, 1), width)

    speculator.propose = recorded
    pos, root = len(prompt), 42
    (tree,), _ = speculator.draft([root], [pos], 3, [prompt + [root]], Sampling())
    # a depth-2 node the draft read (it expanded it), or a depth-3 node it drafted but never read
    ends = [i for i, d in enumerate(tree.depths) if d == 2 and tree.draft_slots[i] is not None] if last_node_fed \
        else [i for i, d in enumerate(tree.depths) if d == 3]
    path = branch(tree.parents, ends[-1])[1:]
    assert tree.draft_slots[path[1]] != pos + 2  # its keys/values are not where they belong
    speculator.accepted([path], [tree], [pos])
    assert speculator.pending[0] == ([] if last_node_fed else [tree.tokens[path[-1]]])

    sequence = prompt + [root] + [tree.tokens[i] for i in path]
    pos, root = pos + 1 + len(path), 99
    calls.clear()
    speculator.draft([root], [pos], 3, [sequence + [root]], Sampling())
    want = full_forward(fresh, sequence + [root])
    (fed, got), (frontier, frontier_logits) = calls[:2]
    torch.testing.assert_close(got[0], want[-len(fed[0]):], rtol=1e-5, atol=1e-5)  # pending token + root
    for token, logits in zip(frontier[0].tolist(), frontier_logits[0]):  # the first expanded level
        torch.testing.assert_close(logits, full_forward(fresh, sequence + [root, token])[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, top_k=6)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k,nodes", [(3, 9), (4, 16), (2, 5), (1, 3), (2, 12)])
@torch.no_grad()
def test_one_graph_tree_equals_the_host_tree(near_draft, k, nodes, sampling):
    """draft_tree (a tree's K draft forwards in one call, two graphs when compiled) grows the tree that draft() grows
    depth by depth on the host: the same tokens, parents, acceptance-table cells, draft slots and (sampled, same
    seed: the same draws) proposals, step after step as accepted paths compact the cache and the table learns."""
    speculators = [draftmodel.ModelDrafter(Engine(generation.load_model(near_draft)), k, nodes) for _ in range(2)]
    speculators[1].grow_tree = None  # the host path
    assert speculators[0].grow_tree.func is draftmodel.draft_tree
    prompt, rng = [1, 17, 33, 250, 7, 90], random.Random(k)
    for speculator in speculators:
        speculator.start([prompt], 96)
    context, pos, depths = prompt + [42], len(prompt), set()
    for step in range(5):
        trees = []
        for speculator in speculators:
            torch.manual_seed(step)
            trees.append(speculator.draft([context[-1]], [pos], k, [context], sampling)[0][0])
        one_graph, host = ((t.tokens, t.parents, t.cells, t.draft_slots) for t in trees)
        assert one_graph == host
        assert len(trees[0].tokens) == nodes + 1 or sampling.temperature  # top-k may leave fewer to draw
        for got, want in zip(*(t.proposals for t in trees)):
            if sampling.temperature and want is not None:
                torch.testing.assert_close(got, want)
            else:
                assert got is None and want is None
        path = branch(trees[0].parents, rng.randrange(1, len(trees[0].tokens)))[1:]
        depths.add(len(path))
        for speculator, tree in zip(speculators, trees):
            speculator.accepted([path], [tree], [pos])
        new = [trees[0].tokens[i] for i in path] + [rng.randrange(64)]
        context, pos = context + new, pos + len(new)
    assert max(depths) >= min(k, 2)  # paths through expanded nodes were accepted


@pytest.mark.parametrize("k,nodes,width", [(5, 5, 1), (5, 6, 4), (5, 10, 4), (5, 16, 4), (2, 12, 6), (3, 40, 8)])
def test_tree_width(random_draft, k, nodes, width):
    """Children per expanded node: ceil(N / K), at least MIN_TREE_WIDTH (a small tree of width 2 chose its nodes
    among too few candidates), at most 8; a chain (N == K) has one."""
    speculator = draftmodel.ModelDrafter(Engine(generation.load_model(random_draft)), k, nodes)
    assert speculator.width == width and draftmodel.AcceptanceTable(width).lookup_cells == speculator.table.lookup_cells
    assert speculator.lookahead >= max(nodes, (k - 1) * width)  # the draft cache's room for a step's tree


@torch.no_grad()
def test_draft_reads_accepted_lookup_tokens_before_its_next_step(random_draft):
    """A merged tree (draft + n-gram lookup): when the verifier accepts a looked-up branch the draft
    never read, the draft reads all of it before the next root, and its logits then equal a fresh
    model's on the prefix and the accepted branch read as one sequence."""
    draft, fresh = generation.load_model(random_draft), generation.load_model(random_draft)
    fresh.setup_caches(1, 64)
    speculator = draftmodel.ModelDrafter(Engine(draft), 3, 16, ngram=2)
    prompt = [1, 17, 33, 250, 42, 5, 6, 7, 90, 11]
    speculator.start([prompt], 64)
    pos, root = len(prompt), 42  # the lookup proposes 5, 6, 7: what followed 42 before
    (tree,), _ = speculator.draft([root], [pos], 3, [prompt + [root]], Sampling())
    path, node = [], 0
    for token in (5, 6, 7):
        node = next(c for c in tree.children()[node] if tree.tokens[c] == token)
        path.append(node)
    assert all(tree.draft_slots[n] is None for n in path)  # only the lookup proposed them
    speculator.accepted([path], [tree], [pos])
    assert speculator.pending[0] == [5, 6, 7]
    reads = []

    def recorded(x, input_pos, slots, mask, width, last):
        reads.append((x, draft(x, input_pos, slots, mask)))
        return draftmodel.greedy_candidates(reads[-1][1][:, -1] if last else reads[-1][1].flatten(0, 1), width)

    speculator.propose = recorded
    sequence, root = prompt + [42, 5, 6, 7], 99
    _, forwards = speculator.draft([root], [len(sequence)], 3, [sequence + [root]], Sampling())
    assert forwards == 1 + 3  # the looked-up tokens, then root and two depths
    fed, logits = reads[0]
    assert fed.tolist() == [[7, root]]
    torch.testing.assert_close(logits[0], full_forward(fresh, sequence + [root])[-2:], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- greedy: token identity

@pytest.mark.parametrize("draft,k,nodes", [("near", 4, 10), ("near", 3, 16), ("near", 2, 5), ("near", 8, 24),
                                           ("self", 3, 16), ("random", 4, 10),
                                           pytest.param("trained", 4, 10, marks=pytest.mark.slow)])
def test_greedy_tree_identical_to_plain_decoding(random_target, near_draft, random_draft, request, draft, k, nodes):
    if draft == "trained":
        trained_pair = request.getfixturevalue("trained_pair")
        target, path = trained_pair / "target/model.pth", trained_pair / "draft/model.pth"
    else:
        target, path = random_target, {"near": near_draft, "self": random_target, "random": random_draft}[draft]
    prompt = PROMPTS[k % 2]
    stats = speculative(target, path, k, "--tree_nodes", nodes, "--ignore_eos", prompt=prompt)
    assert tokens(stats) == plain_greedy(target, prompt)[:29]
    # the tree's size and the distribution of accepted depths
    counts = stats["accept_counts"]
    assert stats["tree_nodes"] == nodes and stats["speculate_k"] == k and len(counts) == k + 1
    steps = sum(counts)
    assert steps == stats["target_forwards"] - 1 and stats["draft_forwards"] == 1 + k * steps
    if draft in ("near", "self"):
        assert max(i for i, c in enumerate(counts) if c) >= 2  # deeper than one token


def test_greedy_tree_stops_exactly(random_target, near_draft, tmp_path):
    want = plain_greedy(random_target)
    for n in (1, 2, 6, 11, 17):
        got = speculative(random_target, near_draft, 4, "--tree_nodes", 10, "--ignore_eos", n=n)
        assert tokens(got) == want[:n]
    j = 7
    assert want[j] not in want[:j]
    target = copy_checkpoint(random_target, tmp_path / "eos", eos_token_id=want[j])
    assert tokens(speculative(target, near_draft, 4, "--tree_nodes", 10, n=30)) == want[:j + 1]


REPEATING = "def f(x):\n    return x\n\n" * 3 + "def f("


@pytest.mark.parametrize("draft,k,nodes,prompt", [
    pytest.param("trained", 4, 10, PROMPTS[0], marks=pytest.mark.slow), ("random", 5, 16, REPEATING),
    ("near", 3, 9, REPEATING)])
def test_greedy_merged_tree_identical_to_plain_decoding(random_target, near_draft, random_draft, request,
                                                        draft, k, nodes, prompt):
    """The draft model's tree with the n-gram lookup's branches merged in gives the plain greedy tokens."""
    if draft == "trained":
        trained_pair = request.getfixturevalue("trained_pair")
        target, path = trained_pair / "target/model.pth", trained_pair / "draft/model.pth"
    else:
        target, path = random_target, {"near": near_draft, "random": random_draft}[draft]
    stats = speculative(target, path, k, "--tree_nodes", nodes, "--draft_ngram", 3, "--ignore_eos", prompt=prompt, n=40)
    assert tokens(stats) == plain_greedy(target, prompt, 40)
    assert stats["speculative"] == "tree" and stats["tree_nodes"] == nodes
    steps = sum(stats["accept_counts"])
    assert stats["draft_forwards"] >= 1 + k * steps


def test_acceptance_table_learns_which_children_the_verifier_accepts():
    """The draft prefers token 0 then 1, but the verifier keeps taking its second guess: after a few
    dozen steps the second child outranks the first, with estimates near the observed rates."""
    table = draftmodel.AcceptanceTable(width=2)
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])

    def children():
        return table.rank(*draftmodel.greedy_candidates(logits, 2))

    [(first, second)] = children()
    assert (first[0], second[0]) == (0, 1) and first[1] > second[1]  # before any evidence: the draft's order
    tree = speculate.Tree.rooted_at(9)
    tree.add(0, 0, cell=first[2])
    tree.add(1, 0, cell=second[2])
    for _ in range(50):
        table.observe(tree, [2])
    [(first, second)] = children()
    assert (first[0], second[0]) == (0, 1)
    assert math.exp(second[1]) > 0.85 and math.exp(first[1]) < 0.15


@pytest.mark.parametrize("extra", [["--draft_ngram", 3], ["--draft_ngram", 3, "--speculate_k", 4, "--tree_nodes", 10],
                                   ["--draft_ngram", 2, "--speculate_k", 2]])
@pytest.mark.parametrize("prompt", [PROMPTS[0], REPEATING], ids=["prompt", "repeating prompt"])
def test_ngram_greedy_identical_to_plain_decoding(random_target, extra, prompt):
    stats = run(random_target, "--ignore_eos", *extra, prompt=prompt, n=40)
    assert tokens(stats) == plain_greedy(random_target, prompt, 40)
    assert stats["speculative"] == "ngram" and stats["draft_forwards"] == 0
    assert sum(stats["accept_counts"][2:]) > 0  # the n-grams did hit
    short = tokens(run(random_target, "--ignore_eos", *extra, prompt=prompt, n=7))
    assert short == plain_greedy(random_target, prompt, 40)[:7]


# ----------------------------------------------------------------------------- sampled trees are lossless
#
# The chi-square test of test_speculative.py (DRAWS draws of the two tokens after a fixed prefix, against the
# target's distribution by enumeration) with a depth-2 tree of 6 nodes: 3 children drawn without replacement
# per expanded node (12 drafted, 6 kept), verified one after another against the residual; optionally with
# an n-gram lookup's deterministic branch merged in at the root. The draft is noisy and confident, so the
# first child is often rejected and the later siblings decide a large share of the tokens. Each broken
# variant must be rejected.

FAR_DRAFT = (1.0, 4.0)  # noise and sharpening of the draft (helpers.tiny_tables)

real_sampled_children = draftmodel.ModelDrafter.sampled_children
real_sampled_candidates = draftmodel.sampled_candidates
real_tree_children = draftmodel.tree_children
real_without = speculate.without


def drawn_with_replacement(q, width):
    """Broken: siblings drawn independently (with replacement), verified as if drawn without."""
    _, log_top, log_prior = real_sampled_candidates(q, width)
    return torch.stack([speculate.sample_from(q) for _ in range(width)], -1), log_top, log_prior


def kept_by_their_own_values(logits, sampling, width, *counts):
    """Broken: children scored by their own draft probability, so the tree_nodes cut looks at the draws."""
    tokens, _, cells, q = real_tree_children(logits, sampling, width, *counts)
    return tokens, q.gather(-1, tokens).log().double(), cells, q


def not_renormalized(q, tokens):
    """Broken: the earlier siblings are removed from q_i, but q_i is not renormalized."""
    if q is None or not tokens:
        return q
    return q.index_fill(0, torch.tensor(tokens), 0)


def lookups_not_excluded(self, logits, sampling, exclude=None):
    """Broken: the root's children are drawn from q, but verified as if drawn with the looked-up tokens excluded."""
    rows = real_sampled_children(self, logits, sampling)
    for r, looked_up in enumerate(exclude or []):
        excluded = real_without(speculate.logits_to_probs(logits[r], sampling), list(looked_up))
        rows[r] = [(token, excluded, score, cell) for token, _, score, cell in rows[r]]
    return rows


T1, T07_TOPK_TOPP, T05_TOPP = Sampling(1.0), Sampling(0.7, top_k=5, top_p=0.9), Sampling(0.5, top_p=0.8)
NEAR_DRAFT = (0.5, 2.0)  # closer to the target: it draws the looked-up token often enough to expose that bug
TREE_CASES = {  # name: (sampling, n-gram n, (what to break, broken function) or None, draft)
    "temperature 1": (T1, 0, None, FAR_DRAFT),
    "temperature 0.7, top-k, top-p": (T07_TOPK_TOPP, 0, None, FAR_DRAFT),
    "temperature 0.5, top-p": (T05_TOPP, 0, None, FAR_DRAFT),
    "temperature 1, merged 2-gram lookups": (T1, 2, None, FAR_DRAFT),
    "temperature 0.7, top-k, top-p, merged 2-gram lookups": (T07_TOPK_TOPP, 2, None, FAR_DRAFT),
    "broken: siblings drawn with replacement": (T1, 0, ("sampled_candidates", drawn_with_replacement), FAR_DRAFT),
    "broken: kept by their own values": (T1, 0, ("tree_children", kept_by_their_own_values), FAR_DRAFT),
    "broken: q_i not renormalized": (T1, 0, ("without", not_renormalized), FAR_DRAFT),
    "broken: looked-up tokens not excluded from the draws": (T1, 2, ("sampled_children", lookups_not_excluded),
                                                             NEAR_DRAFT),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", TREE_CASES)
def test_sampled_tree_is_lossless(case, monkeypatch):
    sampling, ngram, breakage, draft = TREE_CASES[case]
    seen = {"most root children": 0, "later sibling accepted": 0, "looked-up child tried": 0}
    verify = speculate.verify

    def watched_verify(tree, target_probs):
        path, token = verify(tree, target_probs)
        children = tree.children()[0]
        seen["most root children"] = max(seen["most root children"], len(children))
        seen["later sibling accepted"] += bool(path) and path[0] != children[0]
        seen["looked-up child tried"] += any(tree.proposals[child] is None for child in children)
        return path, token

    monkeypatch.setattr(speculate, "verify", watched_verify)
    if breakage is not None:
        name, broken = breakage
        # `without` serves both the draws (draftmodel) and the verifier (speculate); the rest live in draftmodel
        owners = {"sampled_children": [draftmodel.ModelDrafter], "without": [draftmodel, speculate]}
        for owner in owners.get(name, [draftmodel]):
            monkeypatch.setattr(owner, name, broken)
    pvalues, accept_counts = lossless_pvalues(6, sampling, ngram, draft=draft)
    if breakage is None:
        assert min(pvalues.values()) > REJECT_BELOW, pvalues
        assert seen["most root children"] >= 3 and seen["later sibling accepted"] > 0.01 * DRAWS, seen
        assert accept_counts[0] > 0 and sum(accept_counts[1:]) > 0
        assert (seen["looked-up child tried"] > 0.5 * DRAWS) == (ngram > 0), seen  # the lookup's branch was in the tree
    else:
        assert min(pvalues.values()) < REJECT_BELOW, pvalues


@pytest.mark.parametrize("broken", [False, True], ids=["lossless", "broken: siblings drawn with replacement"])
def test_small_chi_square_of_a_sampled_tree(broken, monkeypatch):
    """The quick loop's chi-square of a sampled tree (the full table above is marked slow)."""
    if broken:
        monkeypatch.setattr(draftmodel, "sampled_candidates", drawn_with_replacement)
    pvalues, _ = lossless_pvalues(6, T1, draft=FAR_DRAFT, draws=3_000)
    assert (min(pvalues.values()) < REJECT_BELOW) == broken, pvalues


def test_lookup_keeps_the_last_samples_and_forgets_on_request():
    lookup = speculate.Lookup(3)
    row = lookup.fresh()  # a row's lookup shares the run's earlier samples
    for i in range(speculate.Lookup.MAX_SAMPLES + 5):
        lookup.finish([1000 + i, 7, 8, 9])
    # the oldest samples are gone from the index (bounded memory in a long-lived server), the newest stay
    assert len(lookup.samples) == speculate.Lookup.MAX_SAMPLES
    assert (1000,) not in lookup.in_samples and (1000 + speculate.Lookup.MAX_SAMPLES + 4,) in lookup.in_samples
    assert row.trie([5, 7, 8], 1) == {9: [speculate.Lookup.MAX_SAMPLES, {}]}
    speculator = speculate.Speculator(speculate.NgramDrafter(3, 4, 4))
    speculator.drafter.lookup.finish([7, 8, 9])
    speculator.forget()
    assert speculator.drafter.lookup.fresh().trie([5, 7, 8], 1) == {}
