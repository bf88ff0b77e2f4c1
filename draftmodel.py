"""A draft model as the drafter: chains and EAGLE-2-style dynamic token trees, their per-step work as tensor
functions compiled into few graphs (draft_chain: one; draft_tree: two), the acceptance table that ranks tree nodes, and
make_drafter, which picks the drafter for the command line's settings. The loop, the verifier and the n-gram
lookup they share live in speculate.py.
"""
import bisect
import functools
import math
from typing import Optional

import torch
from torch import Tensor

from decode import Engine, Sampling, compile_engine, decode_one_token, exponential_like, logits_to_probs, sdpa_context
from model import UserError
from speculate import MAX_TREE_NODES, Lookup, NgramSpeculator, Tree, TreeSpeculator, move_cache_slots, without

GREEDY_RANK_TEMPERATURE = 0.3  # sharpening of the draft's distribution when ranking tree nodes for greedy decoding
# A tree's width (children per expanded node, nodes expanded per depth) is ceil(N / K), but at least this: the N
# kept nodes are the best of up to width^2 candidates per depth, and a weak draft's top 2 miss the target's argmax
# far more often than its top 4. Greedy, tiny pair, 4 held-out prompts, eager: N = 10, K = 5 rose from 2.39 (width
# 2) to 3.30 target tokens per forward, N = 8 from 2.41 to 3.22; widths above 4 added nothing at N = 16, and at
# T = 0.7 widths 2-4 measured alike within sampling noise (BENCHMARKS.md).
MIN_TREE_WIDTH = 4


def greedy_candidates(logits: Tensor, width: int):
    """The `width` largest logits of each row [rows, V]: token ids, their log q (the draft's
    distribution) and their log prior (q sharpened by GREEDY_RANK_TEMPERATURE), each [rows, width]."""
    logits = logits.float()
    top = torch.topk(logits, width, dim=-1)
    log_q = top.values - torch.logsumexp(logits, -1, keepdim=True)
    sharp = logits / GREEDY_RANK_TEMPERATURE
    log_prior = top.values / GREEDY_RANK_TEMPERATURE - torch.logsumexp(sharp, -1, keepdim=True)
    return top.indices, log_q, log_prior


def draft_logits(model, x: Tensor, input_pos: Tensor, slots: Optional[Tensor], mask: Optional[Tensor],
                 last: bool) -> Tensor:
    """A draft forward over x [B, T]: the logits of each row's last query [B, V] if `last`, else of every
    query, row by row [B * T, V]."""
    logits = model(x, input_pos, slots, mask)  # [B, T, V]
    return logits[:, -1] if last else logits.flatten(0, 1)


def draft_chain(model, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int):
    """`depth` draft tokens in a row, each fed back as the next query, in one graph (DraftModelSpeculator.compile):
    x, input_pos [B, T] at consecutive slots (the distribution of the last query gives the first token). Returns the
    tokens [B, depth] (the argmax at temperature 0, else draws) and, at temperature > 0, the distributions they were
    drawn from [B, depth, V] (else None)."""
    tokens, probs = [], []
    for _ in range(depth):
        token, q = decode_one_token(model, x, input_pos, sampling)  # [B], [B, V]
        tokens.append(token)
        probs.append(q)
        x, input_pos = token.view(-1, 1), input_pos[:, -1:] + 1  # [B, 1] each
    return torch.stack(tokens, 1), torch.stack(probs, 1) if sampling.temperature > 0 else None


def draft_candidates(model, x: Tensor, input_pos: Tensor, slots: Optional[Tensor], mask: Optional[Tensor],
                     width: int, last: bool):
    """draft_logits() and greedy_candidates() of them, in one graph when compiled."""
    return greedy_candidates(draft_logits(model, x, input_pos, slots, mask, last), width)


class AcceptanceTable:
    """How likely the verifier is to accept a drafted tree node, learned while generating.

    EAGLE-2 (Li et al. 2024) ranks nodes by the draft's own probability, which presumes a calibrated
    draft; Sequoia (Chen et al. 2024) measures instead how often the k-th most likely child is accepted.
    Here each child falls in a cell (its rank among its siblings, a bucket of the draft's probability q
    of it, a bucket of the prior: q sharpened for greedy verification, which accepts the target's
    argmax rather than a sample). Over the children of nodes the verifier reached, each cell counts how
    many were reached and accepted, recent steps weighing more, and estimates
    P(accept | parent reached) = (accepted + w * prior) / (reached + w).
    A node's score is the sum of these log-estimates along its path."""
    LOG_Q_EDGES = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, -0.2)
    PRIOR_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95)
    PRIOR_WEIGHT = 4.0  # w: the prior counts as this many observations
    DECAY = 0.98  # per verification step

    LOOKUP_PRIOR = 0.5  # prior of a looked-up child: this times the share of the lookups that continue with it

    def __init__(self, width: int):
        self.cells_per_rank = (len(self.LOG_Q_EDGES) + 1) * (len(self.PRIOR_EDGES) + 1)
        self.lookup_cells = width * self.cells_per_rank  # then one cell per PRIOR_EDGES bucket
        self.reached = [0.0] * (self.lookup_cells + len(self.PRIOR_EDGES) + 1)
        self.accepted = [0.0] * len(self.reached)
        self.unit = 1.0  # what one observation counts now (counts are in units of the latest step's)

    def rank(self, tokens: Tensor, log_q: Tensor, log_prior: Tensor, keep: Optional[Tensor] = None,
             falling: bool = False) -> list:
        """Score each row's candidates (tensors [rows, width], most probable first): [[(token, log-estimate,
        cell)]], for the candidates in `keep` (default: those of prior > 0). falling: a candidate never scores
        above the one before it (the running minimum along the row)."""
        scores, cells = table_estimates(log_q.cpu(), log_prior.cpu(), *self.counts())
        prior = log_prior.double().cpu().exp()
        if falling:
            scores = scores.cummin(-1).values
        keep = (prior > 0) if keep is None else keep.cpu()
        return [[(t, s, c) for t, s, c, k in zip(*row) if k]
                for row in zip(tokens.tolist(), scores.tolist(), cells.tolist(), keep.tolist())]

    def counts(self):
        """(accepted, reached) per cell as float64 tensors, and the prior's weight w as a 1-element tensor (a 0-d
        one would enter a compiled graph as a Python float, which costs dynamo a second trace)."""
        return (torch.tensor(self.accepted, dtype=torch.double), torch.tensor(self.reached, dtype=torch.double),
                torch.tensor([self.PRIOR_WEIGHT * self.unit], dtype=torch.double))

    def lookup(self, share: float):
        """(log-estimate, cell) of a child that continues `share` of the n-gram lookup's occurrences."""
        prior = self.LOOKUP_PRIOR * share
        cell = self.lookup_cells + bisect.bisect(self.PRIOR_EDGES, prior)
        return math.log(min(max(self.estimate(cell, prior), 1e-12), 1.0)), cell

    def estimate(self, cell: int, prior: float) -> float:
        weight = self.PRIOR_WEIGHT * self.unit
        return (self.accepted[cell] + weight * prior) / (self.reached[cell] + weight)

    def observe(self, tree: Tree, path: list):
        """The verifier reached the root and every accepted node, and accepted the nodes on the path."""
        cells = tree.cells
        kids, on_path = tree.children(), set(path)
        self.unit /= self.DECAY  # decaying every count = counting new observations as more units
        if self.unit > 1e100:
            self.reached = [n / self.unit for n in self.reached]
            self.accepted = [n / self.unit for n in self.accepted]
            self.unit = 1.0
        for node in [0] + path:
            for child in kids[node]:
                self.reached[cells[child]] += self.unit
                self.accepted[cells[child]] += self.unit if child in on_path else 0.0


def table_estimates(log_q: Tensor, log_prior: Tensor, accepted: Tensor, reached: Tensor, weight: Tensor):
    """AcceptanceTable's log-estimate and cell of each candidate ([rows, width] each, most probable first) from the
    table's counts (AcceptanceTable.counts); in a graph or on the host alike. A candidate of prior 0 scores -inf."""
    table = AcceptanceTable
    log_q, log_prior = log_q.double(), log_prior.double()
    prior = log_prior.exp()
    rank = torch.arange(log_q.shape[-1], device=log_q.device).expand_as(prior)
    q_bucket = torch.bucketize(log_q, torch.tensor(table.LOG_Q_EDGES, dtype=torch.double, device=log_q.device),
                               right=True)
    prior_bucket = torch.bucketize(prior, torch.tensor(table.PRIOR_EDGES, dtype=torch.double, device=log_q.device),
                                   right=True)
    cells = (rank * (len(table.LOG_Q_EDGES) + 1) + q_bucket) * (len(table.PRIOR_EDGES) + 1) + prior_bucket
    scores = ((accepted[cells] + weight * prior) / (reached[cells] + weight)).clamp(1e-12, 1.0).log()
    return scores.masked_fill(prior == 0, -math.inf), cells


def sampled_candidates(q: Tensor, width: int):
    """`width` draws without replacement from each row of q [rows, V], in the order drawn, by Gumbel-top-k (Kool et
    al. 2019: the k largest log q(x) + G(x), G i.i.d. Gumbel); the log of q's `width` largest probabilities, sorted
    (what a draw's score may depend on: known before drawing), and the log prior of the i-th draw, the chance
    that it is the i-th most likely token: p_i / (the mass not ranked above it). Each [rows, width]."""
    keys = q.log() - exponential_like(q).log()  # log q + Gumbel noise
    drawn = torch.topk(keys, width, dim=-1).indices
    top = torch.topk(q, width, dim=-1).values.double()
    left = 1.0 - (top.cumsum(-1) - top)
    return drawn, top.log(), (top / left.clamp_min(1e-30)).clamp_max(1.0).log()


def tree_children(logits: Tensor, sampling: Sampling, width: int, accepted: Tensor, reached: Tensor, weight: Tensor):
    """The children of each row of logits [rows, V], as DraftModelSpeculator.read gives them: tokens, log-estimates
    and cells [rows, width] (greedy: the most probable first; sampled: draws in order, scores falling along
    ranks) and the distribution q they were drawn from [rows, V] (None at temperature 0)."""
    if sampling.temperature == 0:
        tokens, log_q, log_prior = greedy_candidates(logits, width)
        return (tokens, *table_estimates(log_q, log_prior, accepted, reached, weight), None)
    q = logits_to_probs(logits, sampling)
    tokens, log_top, log_prior = sampled_candidates(q, width)
    scores, cells = table_estimates(log_top, log_prior, accepted, reached, weight)
    return tokens, scores.cummin(-1).values, cells, q


def tree_root(model, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int, width: int, accepted: Tensor,
              reached: Tensor, weight: Tensor):
    """draft_tree's first forward: the root's children, and the buffers tree_depth() fills, each [B, M] in the
    candidates' order: tokens, parents, cells, scores (one more column, -inf, that padding of `newest` points at),
    rows of qs, draft slots; newest [B, width^2]: the latest depth's candidates (the root's children, then padding);
    seen [B, width, span]: the tree slots each frontier node sees; qs [B, R, V] (None at temperature 0)."""
    batch, device = x.shape[0], x.device
    span = max(depth - 1, 1) * width  # the draft-cache slots after the root that frontier nodes are read at
    size = 1 + width + (depth - 1) * width * width
    pos = input_pos[:, -1:]  # [B, 1] the root's slot
    tokens, scores, cells, q = tree_children(model(x, input_pos)[:, -1], sampling, width, accepted, reached, weight)
    rest = torch.zeros(batch, size - 1 - width, dtype=tokens.dtype, device=device)  # filled by tree_depth()
    root = torch.full_like(pos, -1)
    all_tokens = torch.cat([x[:, -1:], tokens, rest], 1)  # [B, M]
    all_parents = torch.cat([root, torch.zeros_like(tokens), rest], 1)
    all_cells = torch.cat([root, cells, rest], 1)
    rows = torch.cat([root, torch.zeros_like(tokens), rest], 1)  # each candidate's row of qs (its parent's)
    all_scores = torch.cat([torch.zeros_like(scores[:, :1]), scores,
                            torch.full((batch, size - width), -math.inf, dtype=scores.dtype, device=device)], 1)
    slots = torch.cat([pos, torch.full((batch, size - 1), -1, dtype=pos.dtype, device=device)], 1)  # [B, M]
    newest = torch.cat([torch.arange(1, 1 + width, device=device),
                        torch.full((width * width - width,), size, device=device)]).expand(batch, -1)
    seen = torch.zeros(batch, width, span, dtype=torch.bool, device=device)
    qs = None
    if q is not None:  # the root's distribution, then each frontier node's [B, 1 + (K - 1) * width, V]
        qs = torch.cat([q.unsqueeze(1), q.new_zeros(batch, (depth - 1) * width, q.shape[-1])], 1)
    return all_tokens, all_parents, all_cells, all_scores, rows, slots, newest, seen, qs


def tree_depth(model, state: tuple, d: Tensor, pos: Tensor, sampling: Sampling, width: int, accepted: Tensor,
               reached: Tensor, weight: Tensor):
    """One later forward of draft_tree: expand the `width` best of the newest candidates (a stable sort: ties to the
    earlier; padding scores -inf and sorts after them), give each `width` children. d [1]: the depth expanded."""
    all_tokens, all_parents, all_cells, all_scores, rows, slots, newest, seen, qs = state
    batch, device = all_tokens.shape[0], all_tokens.device
    span = seen.shape[-1]
    order = torch.sort(all_scores.gather(1, newest), dim=-1, descending=True, stable=True).indices[:, :width]
    frontier = newest.gather(1, order)  # [B, width]
    first = (d - 1) * width  # [1]: the frontier's first slot after the root, minus one
    read_at = pos + 1 + first + torch.arange(width, device=device)  # [B, width]
    slots = slots.scatter(1, frontier, read_at)
    parent = order // width  # each one's parent's place in the last frontier (depth 1: the root's, all 0)
    own = torch.arange(span, device=device) == first + torch.arange(width, device=device).view(-1, 1)  # [width, S']
    seen = seen.gather(1, parent.unsqueeze(-1).expand(-1, -1, span)) | own  # [B, width, span]
    cache_slots = torch.arange(model.max_seq_length, device=device)  # [S]
    offset = (cache_slots - (pos + 1)).clamp(0, span - 1).unsqueeze(1).expand(batch, width, -1)  # [B, width, S]
    after_root = ((cache_slots > pos) & (cache_slots <= pos + span)).unsqueeze(1)  # [B, 1, S]
    mask = (cache_slots <= pos).unsqueeze(1) | (seen.gather(2, offset) & after_root)  # [B, width, S]
    fed = all_tokens.gather(1, frontier)  # [B, width]
    logits = model(fed, (pos + d).expand(batch, width), read_at, mask.unsqueeze(1))  # [B, width, V]
    tokens, scores, cells, q = tree_children(logits.flatten(0, 1), sampling, width, accepted, reached,
                                             weight)  # [B * width, width] each, q [B * width, V]
    new = (1 + width + first * width + torch.arange(width * width, device=device)).expand(batch, -1)  # [B, width^2]
    if qs is not None:
        at = (1 + first + torch.arange(width, device=device)).view(1, width, 1).expand(batch, width, qs.shape[-1])
        qs = qs.scatter(1, at, q.view(batch, width, -1))  # [B, R, V]
    rows = rows.scatter(1, new, (1 + first + torch.arange(width, device=device)).repeat_interleave(width)
                        .expand(batch, -1))
    all_tokens = all_tokens.scatter(1, new, tokens.view(batch, width * width))
    all_parents = all_parents.scatter(1, new, frontier.repeat_interleave(width, 1))  # [B, width * width]
    all_cells = all_cells.scatter(1, new, cells.view(batch, width * width))
    below = all_scores.gather(1, frontier).unsqueeze(-1) + scores.view(batch, width, width)  # [B, width, width]
    all_scores = all_scores.scatter(1, new, below.view(batch, width * width))
    return all_tokens, all_parents, all_cells, all_scores, rows, slots, new, seen, qs


def draft_tree(model, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int, width: int, accepted: Tensor,
               reached: Tensor, weight: Tensor, root=tree_root, step=tree_depth):
    """The dynamic tree of every row with no host sync: the tree that DraftModelSpeculator.draft grows depth by depth
    on the host (without lookups). K forwards: tree_root(), then tree_depth() once per later depth on fixed-shape
    buffers, so that compiled (DraftModelSpeculator.compile) they are two graphs whatever K, not K unrolled forwards
    in one graph (which took inductor about a minute on 2 cores for K = 5).
    x, input_pos [B, 2]: the token before the root and the root, at slots pos - 1 and pos; accepted, reached,
    weight: the acceptance table's counts (AcceptanceTable.counts).

    Candidates, in the order draft() adds them: the root (index 0), its `width` most probable children, then at
    each depth d >= 2 `width` children of each frontier node (the `width` best-scored nodes of depth d - 1, best
    first: a stable sort, ties to the earlier node), M = 1 + width + (depth - 1) * width^2 in all. Frontier node
    j of depth d is read at slot pos + 1 + (d - 1) * width + j (RoPE position pos + d), seeing the prefix up to
    the root and the slots of its ancestors. Returns the candidates other than the root best first [B, M - 1]
    (by score, ties to the earlier: select()'s order, so the first tree_nodes hold each one's parent); per
    candidate [B, 6, M]: token, parent (-1: the root), cell (-1: the root), draft slot (-1: never read), 1 where
    it may be kept (0: a candidate of prior 0, which the host path never adds, nor its children), and its row of
    the distributions it was drawn from; those distributions at temperature > 0 [B, 1 + (K - 1) * width, V]
    (the root's, then each frontier node's; else None).

    At temperature > 0 the children are tree_children()'s draws without replacement, scored only by what was known
    before they were drawn, as DraftModelSpeculator.sampled_children explains: the same tree, the same draws
    (eager, same seed), hence lossless for the same reason."""
    state = root(model, x, input_pos, sampling, depth, width, accepted, reached, weight)
    pos = input_pos[:, -1:]  # [B, 1] the root's slot
    depths = torch.arange(depth, device=x.device)  # the depth as a tensor: one graph serves every depth
    for d in range(1, depth):
        state = step(model, state, depths[d:d + 1], pos, sampling, width, accepted, reached, weight)
    all_tokens, all_parents, all_cells, all_scores, rows, slots, _, _, qs = state
    size = all_tokens.shape[1]
    ranked = torch.sort(all_scores[:, 1:size], dim=-1, descending=True, stable=True).indices + 1  # [B, M - 1]
    nodes = torch.stack([all_tokens, all_parents, all_cells, slots, (all_scores[:, :size] > -math.inf).long(), rows],
                        1)  # [B, 6, M]
    return ranked, nodes, qs


class DraftModelSpeculator(TreeSpeculator):
    """A small draft model grows the tree one depth per forward (EAGLE-2 style dynamic tree): expand the
    `width` best-scored nodes of the newest depth, give each `width` children, and keep the tree_nodes best
    nodes overall, a node's score being the acceptance table's log-estimate summed along its path (with
    --draft_ngram, the lookup's branches are merged in first). With width 1 (tree_nodes == depth) this is
    the classic chain.

    Children: at temperature 0 the draft's `width` most probable tokens. At temperature > 0 they are drawn
    without replacement from the draft's warped distribution q (same temperature / top-k / top-p as the
    target's), so verify() tries each against the target's residual with min(1, p_i/q_i), which accepts far
    more than a deterministic pick's p(x) (see sampled_children for why the tree stays lossless)."""
    kind = "draft"

    def __init__(self, draft_model, depth: int, tree_nodes: int, auto_depth: bool = False, ngram: int = 0):
        super().__init__(depth, tree_nodes, auto_depth)
        self.draft_model = draft_model
        self.device = draft_model.tok_embeddings.weight.device
        self.lookup = Lookup(ngram) if ngram else None  # n-gram branches merged into the draft's tree
        self.lookups = []  # one per row of the current generation (sharing self.lookup's earlier samples)
        self.kind = "draft" if tree_nodes == depth else "tree"  # stats: a chain, or token-tree verification
        self.width = 1 if tree_nodes == depth else min(8, max(MIN_TREE_WIDTH, math.ceil(tree_nodes / depth)))
        self.lookahead = max(tree_nodes, (depth - 1) * self.width) + 2
        self.engine = Engine(draft_model)
        self.candidates, self.logits = draft_candidates, draft_logits
        self.draft_forward = draft_model  # what candidates() / logits() run: the model, or its regional forward
        # a fixed-depth chain's K draft steps in one call (draft_chain), compiled as one graph where the draft compiles
        # whole; None: step by step through read() (trees, --speculate_k auto, a regionally compiled draft)
        self.chain = draft_chain if self.width == 1 and not auto_depth else None
        # likewise a tree without lookups (draft_tree: two graphs, the first depth's and the later depths'), greedy
        # or sampled; None: depth by depth on the host (merged lookups, a regionally compiled draft)
        self.tree = draft_tree if self.width > 1 and not ngram else None
        self.table = AcceptanceTable(self.width)  # kept across the samples of one run
        self.pending = []  # per row: accepted tokens not yet in the draft's cache (they come before the next root)

    def compile(self, device: str, compile_prefill: bool = False, whole_graph: Optional[bool] = None,
                autotune: bool = False):
        """Static graphs for the per-step forwards (decode.compile_engine: by default on CPU the whole draft as one
        graph when it is shallow, else one compiled block serving every layer; CUDA graphs on GPU); the draft's
        prefill and its catch-up on looked-up tokens (once per generation, or rare) stay eager unless
        compile_prefill."""
        self.engine = compile_engine(self.draft_model, device, compile_prefill, whole_graph, autotune)
        options = self.engine.graph_kwargs
        if options is not None:  # the draft compiled whole
            if self.chain is not None:  # one graph, one host sync, one CUDA graph for K tokens
                self.chain = torch.compile(draft_chain, fullgraph=True, dynamic=False, **options)
            if self.tree is not None:  # two graphs: the first depth, and one for every later depth
                self.tree = functools.partial(
                    draft_tree, root=torch.compile(tree_root, fullgraph=True, dynamic=False, **options),
                    step=torch.compile(tree_depth, fullgraph=True, dynamic=False, **options))
            self.candidates = torch.compile(draft_candidates, fullgraph=True, dynamic=False, **options)
            self.logits = torch.compile(draft_logits, fullgraph=True, dynamic=False, **options)
        else:  # regional: the engine's forward runs the compiled block for every layer
            self.draft_forward = self.engine.forward
            self.chain = self.tree = None  # a chain steps through the engine's compiled one-token decode

    def start(self, prompts: list, max_seq_length: int) -> int:
        device = self.draft_model.tok_embeddings.weight.device
        self.draft_model.setup_caches(len(prompts), max_seq_length)
        T = max(len(p) for p in prompts)
        x = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)  # [B, T], right-padded
        # the padding's slots are overwritten, in order, before any query sees them (decode.prefill)
        self.engine.write_cache(x, torch.arange(T, device=device).expand(len(prompts), T))  # [B, T]
        self.pending = [[] for _ in prompts]
        self.lookups = [self.lookup.fresh() for _ in prompts] if self.lookup else []
        return 1

    def finish(self, outs: list):
        if self.lookup:
            for out in outs:
                self.lookup.finish(out)

    def draft(self, roots: list, pos: list, depth: int, contexts: list, sampling: Sampling):
        device = self.device
        batch, forwards = len(roots), 0
        # accepted tokens the draft never read sit just before each root: a looked-up path (any length) goes into
        # the cache first, all but its last token; rows with fewer re-read tokens they already hold (same values)
        longest = max(len(p) for p in self.pending)
        if longest > 1:
            at = [[max(0, p - longest + j) for j in range(longest - 1)] for p in pos]  # [B, longest - 1]
            x = torch.tensor([[context[i] for i in row] for context, row in zip(contexts, at)], device=device)
            self.engine.write_cache(x, torch.tensor(at, device=device))
            forwards += 1
        # depth 1: each row's last pending token (or, in rows with none, the token it already holds there) and its
        # root, whose distribution gives the first children; the default causal mask over slots = positions
        if self.chain is not None and depth == self.depth:
            return self.draft_chain(roots, pos, contexts, sampling), forwards + depth
        if self.tree is not None and depth == self.depth:
            return self.draft_tree(roots, pos, contexts, sampling), forwards + depth
        feed = 2 if longest else 1
        x = torch.tensor([context[-feed:] for context in contexts], device=device)  # [B, feed]
        input_pos = torch.tensor(pos, device=device).view(-1, 1) + torch.arange(1 - feed, 1, device=device)  # [B, feed]
        tries = [lookup.trie(context, depth) for lookup, context in zip(self.lookups, contexts)] \
            if self.lookup else [{}] * batch
        exclude = [list(trie) for trie in tries] if sampling.temperature else None
        children = [[kids] for kids in self.read(x, input_pos, None, None, sampling, exclude, last=True)]
        forwards += 1
        self.pending = [[] for _ in roots]
        trees = [Tree.rooted_at(root, p) for root, p in zip(roots, pos)]
        scores = [[0.0] for _ in roots]
        frontiers = [[0] for _ in roots]
        for d in range(1, depth + 1):
            newest = [[] for _ in roots]
            for b, tree in enumerate(trees):
                for parent, kids in zip(frontiers[b], children[b]):
                    for token, proposal, logp, cell in kids:
                        newest[b].append(tree.add(token, parent, proposal, cell))
                        scores[b].append(scores[b][parent] + logp)
            if d == depth or not any(newest):
                break
            # one forward over every row's frontier (its `width` best newest nodes), each node seeing the row's
            # prefix and its ancestors; a chain sits at consecutive slots (slot = position), where the default
            # causal mask is its tree mask
            frontiers = [sorted(nodes, key=lambda i: -s[i])[: self.width] for nodes, s in zip(newest, scores)]
            base = [p + 1 + (d - 1) * self.width for p in pos]
            rows = []  # [B][width] nodes fed: the frontier, padded with copies of its last node (the root if empty)
            for b, (tree, frontier) in enumerate(zip(trees, frontiers)):
                for j, node in enumerate(frontier):
                    tree.draft_slots[node] = base[b] + j
                rows.append(frontier + (frontier[-1:] or [0]) * (self.width - len(frontier)))
            slots = mask = None
            if self.width > 1:
                mask = torch.cat([self.frontier_mask(tree, row, p, s)  # [B, 1, width, max_seq_length]
                                  for tree, row, p, s in zip(trees, rows, pos, base)]).to(device)
                slots = torch.tensor(base, device=device).view(-1, 1) + torch.arange(self.width, device=device)
            x = torch.tensor([[tree.tokens[n] for n in row] for tree, row in zip(trees, rows)], device=device)
            input_pos = torch.tensor(pos, device=device).view(-1, 1).expand(batch, self.width) + d  # [B, width]
            flat = self.read(x, input_pos, slots, mask, sampling)  # [B * width][children]
            children = [flat[b * self.width: b * self.width + len(frontier)] for b, frontier in enumerate(frontiers)]
            forwards += 1
        out = []
        for tree, s, trie in zip(trees, scores, tries):
            if trie:
                self.merge(tree, s, trie, sampling)
            out.append(self.select(tree, s))
        return out, forwards

    def draft_chain(self, roots: list, pos: list, contexts: list, sampling: Sampling) -> list:
        """The chain of every row through the compiled K-step graph (draft_chain): fed each row's token before the
        root (the draft may not have read it: an accepted last node; else it rewrites that slot) and the root; the
        drafted node at depth d < K is read at slot pos + d, as draft() places a chain."""
        x = torch.tensor([context[-2:] for context in contexts], device=self.device)  # [B, 2]
        input_pos = torch.tensor(pos, device=self.device).view(-1, 1) + torch.arange(-1, 1, device=self.device)
        with sdpa_context():
            tokens, q = self.chain(self.draft_model, x, input_pos, sampling, self.depth)  # [B, K], [B, K, V]
        q = q.clone() if q is not None else None  # out of the graph's output (a CUDA graph's replay overwrites it)
        self.pending = [[] for _ in roots]
        trees = []
        for b, (root, p, row) in enumerate(zip(roots, pos, tokens.tolist())):
            tree = Tree.rooted_at(root, p)
            for d, token in enumerate(row, 1):
                tree.add(token, d - 1, q[b, d - 1] if q is not None else None)
                tree.draft_slots[d] = p + d if d < self.depth else None
            trees.append(tree)
        return trees

    def draft_tree(self, roots: list, pos: list, contexts: list, sampling: Sampling) -> list:
        """Every row's tree through draft_tree, no host sync between its depths (fed, like draft_chain, each row's
        token before the root and the root), cut to the tree_nodes best as select() cuts it."""
        x = torch.tensor([context[-2:] for context in contexts], device=self.device)  # [B, 2]
        input_pos = torch.tensor(pos, device=self.device).view(-1, 1) + torch.arange(-1, 1, device=self.device)
        with sdpa_context():
            ranked, nodes, qs = self.tree(self.draft_model, x, input_pos, sampling, self.depth, self.width,
                                          *self.table.counts())
        qs = qs.clone() if qs is not None else None  # out of the graph's output (a CUDA graph's replay overwrites it)
        self.pending = [[] for _ in roots]
        trees = []
        for b, (root, best, (tokens, parents, cells, slots, usable, rows)) in enumerate(
                zip(roots, ranked.tolist(), nodes.tolist())):
            tree, index = Tree.rooted_at(root, slots[0]), {0: 0}
            for i in sorted([i for i in best if usable[i]][:self.tree_nodes]):  # depth by depth: parents first
                index[i] = tree.add(tokens[i], index[parents[i]], qs[b, rows[i]] if qs is not None else None, cells[i])
                tree.draft_slots[index[i]] = slots[i] if slots[i] >= 0 else None
            trees.append(tree)
        return trees

    def read(self, x: Tensor, input_pos: Tensor, slots, mask, sampling: Sampling, exclude=None, last=False) -> list:
        """One draft forward over x [B, T]; the children of each query (of each row's last one if `last`), best
        first: [[(token, proposal, log-estimate, cell)]], proposal None for a deterministic child.
        `exclude`: per query, tokens it must not draw."""
        if self.width == 1 and x.shape[1] == 1:  # a chain step (at consecutive slots: the causal mask is its tree's):
            with sdpa_context():  # the draft's one-token decode graph, head and warping and drawing compiled in
                tokens, q = self.engine.decode_one_token(self.draft_model, x, input_pos, sampling)
            # its token is the argmax at temperature 0, else a draw from q (decode.sample_from), which the verifier
            # gets; q is copied out of the graph's output (a CUDA graph's next replay overwrites its outputs)
            greedy = sampling.temperature == 0
            q = None if greedy else q.clone()
            return [[(token, None if greedy else q[r], 0.0, None)] for r, token in enumerate(tokens.tolist())]
        with sdpa_context():
            if sampling.temperature == 0:
                tokens, log_q, log_prior = self.candidates(self.draft_forward, x, input_pos, slots, mask, self.width,
                                                           last)
                if self.width == 1:  # chain: the argmax, a point-mass proposal
                    return [[(token, None, 0.0, None)] for token in tokens[:, 0].tolist()]
                rows = self.table.rank(tokens, log_q, log_prior)
                return [[(token, None, score, cell) for token, score, cell in row] for row in rows]
            logits = self.logits(self.draft_forward, x, input_pos, slots, mask, last)
        return self.sampled_children(logits, sampling, exclude)

    def sampled_children(self, logits: Tensor, sampling: Sampling, exclude=None) -> list:
        """For each row of logits [rows, V]: `width` children drawn without replacement from q, the draft's warped
        distribution (minus the row's `exclude`: the looked-up tokens tried deterministically at the same node),
        in the order drawn: [[(token, q, log-estimate, cell)]].

        Gumbel-top-k (Kool et al. 2019): the k largest log q(x) + G(x), G i.i.d. Gumbel, are k draws without
        replacement, in order. Lossless trees need a node's kept children to be a prefix of its draws, chosen
        without looking at them (verify()); so a child's score (and cell) comes from what was known before the
        draw: its rank and q's sorted probabilities. Scores fall along ranks (later siblings never outrank
        earlier ones) and along depth (log-estimates <= 0), and select() breaks ties by depth then index, so
        the tree_nodes cut keeps a node by comparing it only with nodes ranked above it, none of which depend
        on its own value or on draws made after it."""
        q = logits_to_probs(logits, sampling)  # [rows, V]
        for r, tokens in enumerate(exclude or []):
            if tokens:
                q[r] = without(q[r], tokens)
        drawn, log_top, log_prior = sampled_candidates(q, self.width)
        if self.width == 1:
            return [[(token, q[r], 0.0, None)] for r, token in enumerate(drawn[:, 0].tolist())]
        ranked = self.table.rank(drawn, log_top, log_prior, keep=log_top > -math.inf, falling=True)
        return [[(token, q[r], score, cell) for token, score, cell in row] for r, row in enumerate(ranked)]

    def merge(self, tree: Tree, scores: list, trie: dict, sampling: Sampling):
        """Merge the n-gram lookup's trie into the draft's tree (SpecInfer, Miao et al. 2023, merges the
        token trees of several speculators into one), scored by the table's lookup cells.
        Temperature 0: a looked-up child the draft also proposed keeps its node, with the better score; the
        others become new nodes. Temperature > 0: the lookup's branches are deterministic children (point
        masses), chosen from the context alone; the best tree_nodes // 2 of them are kept before any drawn
        node (an offset above every draft score), so which drawn nodes survive the cut never decides which
        looked-up ones do; the root's drawn children exclude the looked-up tokens (read(exclude=...))."""
        sampled = sampling.temperature > 0
        child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p >= 0}
        budget = self.tree_nodes // 2 if sampled else len(tree.tokens) + 10**6
        offset = 1e6 if sampled else 0.0
        level = [(0, trie)]
        while level and budget > 0:  # best-first over the trie, one depth at a time
            below = []
            for parent, branch in level:
                total = sum(count for count, _ in branch.values())
                for token, (count, sub) in sorted(branch.items(), key=lambda kv: -kv[1][0]):
                    score, cell = self.table.lookup(count / total)
                    node = child.get((parent, token))
                    if node is None:
                        if budget <= 0:
                            break
                        budget -= 1
                        node = tree.add(token, parent, None, cell)
                        scores.append(scores[parent] + score + (offset if parent == 0 else 0.0))
                    else:
                        scores[node] = max(scores[node], scores[parent] + score)
                    if sub:
                        below.append((node, sub))
            level = below

    def frontier_mask(self, tree: Tree, frontier: list, pos: int, base: int) -> Tensor:
        """[1, 1, width, max_seq_length]: frontier row j (at slot base + j) sees the prefix up to the root and
        the draft slots of its ancestors and itself (a padding copy sees its original's ancestors)."""
        rows, cols = [], []
        for j, node in enumerate(frontier):
            cols.append(base + j)
            rows.append(j)
            node = tree.parents[node]
            while node > 0:
                rows.append(j)
                cols.append(tree.draft_slots[node])
                node = tree.parents[node]
        mask = torch.zeros(len(frontier), self.draft_model.max_seq_length, dtype=torch.bool)
        mask[:, : pos + 1] = True
        mask[rows, cols] = True
        return mask.view(1, 1, *mask.shape)  # on the host: draft() copies the batch's masks to the device at once

    def select(self, tree: Tree, scores: list) -> Tree:
        """Keep the tree_nodes best nodes; ties go to the shallower, then the earlier node, so a child never
        outranks its parent and the result is a tree."""
        drafted = range(1, len(tree.tokens))
        keep = sorted(drafted, key=lambda i: (-scores[i], tree.depths[i], i))[: self.tree_nodes]
        return tree.subtree(sorted(keep, key=lambda i: (tree.depths[i], i)))

    def accepted(self, paths: list, trees: list, pos: list):
        """Compact the draft's cache like the target's; a last accepted node the draft never consumed
        is fed at the start of the next step. Trees also record which nodes were accepted."""
        rows, src, dst = [], [], []
        for b, (path, tree) in enumerate(zip(paths, trees)):
            if path is None:  # a finished row: nothing moves
                continue
            if self.width > 1:
                self.table.observe(tree, path)
            fed = [node for node in path if tree.draft_slots[node] is not None]
            rows += [b] * len(fed)
            src += [tree.draft_slots[n] for n in fed]
            dst += range(pos[b] + 1, pos[b] + 1 + len(fed))
            self.pending[b] = [tree.tokens[n] for n in path[len(fed):]]
        move_cache_slots(self.draft_model, src, dst, rows)


def make_drafter(draft_model, depth, tree_nodes: Optional[int], ngram: int, max_seq_length: int):
    """The drafter for these settings, or None for plain decoding.
    draft_model: a Transformer or None; depth: draft tokens per step (an int >= 1) or "auto" (an adaptive
    chain up to 8); tree_nodes: tokens verified per step (None: a chain of `depth`); ngram: n of the n-gram
    lookup (0: none). Settings that cannot work raise UserError."""
    auto = depth == "auto"
    depth = 8 if auto else depth
    if draft_model is None and not ngram:
        if tree_nodes is not None:
            raise UserError("--tree_nodes needs a draft: add --draft_checkpoint_path or --draft_ngram N")
        return None
    nodes = tree_nodes if tree_nodes is not None else depth
    if nodes < depth:
        raise UserError(f"--tree_nodes ({nodes}) must be >= --speculate_k ({depth}): a tree holds at least one chain")
    limit = min(MAX_TREE_NODES, max(1, max_seq_length // 4))
    if nodes > limit:
        raise UserError(f"--tree_nodes / --speculate_k of {nodes} is more than this model can use (at most {limit}: "
                        f"{MAX_TREE_NODES}, and a quarter of its {max_seq_length}-token context): lower it")
    if auto and nodes != depth:
        raise UserError("--speculate_k auto adapts a chain: drop --tree_nodes")
    if ngram and ngram < 2:
        raise UserError("--draft_ngram N needs N >= 2 (N - 1 tokens of context find the continuation)")
    if ngram and ngram > 16:
        raise UserError(f"--draft_ngram {ngram}: use N between 2 and 16 (longer contexts rarely recur)")
    if ngram and draft_model is None:
        return NgramSpeculator(ngram, depth, nodes)
    if ngram and nodes == depth:
        raise UserError("--draft_ngram with a draft model merges lookups into the draft's tree: "
                        "add --tree_nodes N > --speculate_k")
    return DraftModelSpeculator(draft_model, depth, nodes, auto, ngram)
