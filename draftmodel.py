"""A draft model as the drafter (ModelDrafter): chains and EAGLE-2-style dynamic token trees, their per-step tensor
functions, and the acceptance table that ranks tree nodes. The loop and the verifier live in speculate.py."""
import bisect
import functools
import math
import time
from typing import Optional

import torch
from torch import Tensor

from decode import Engine, Sampling, decode_one_token, exponential_like, logits_to_probs, move_cache_slots, \
    sdpa_context
from speculate import Lookup, Tree, without

GREEDY_RANK_TEMPERATURE = 0.3  # sharpens q when ranking tree nodes for greedy decoding
# tree width: ceil(N / K), at least this; narrower trees pick their N nodes from too few candidates
MIN_TREE_WIDTH = 4


def tree_width(depth: int, nodes: int) -> int:
    """Children per expanded node: 1 for a chain; else enough for `nodes` over `depth` levels, from MIN_TREE_WIDTH to
    8 (narrower trees pick their nodes from too few candidates)."""
    return 1 if nodes == depth else min(8, max(MIN_TREE_WIDTH, math.ceil(nodes / depth)))


def greedy_candidates(logits: Tensor, width: int):
    """The `width` largest logits of each row [rows, V]: ids, log q and log prior (q sharpened), each [rows, width]."""
    logits = logits.float()
    top = torch.topk(logits, width, dim=-1)
    log_q = top.values - torch.logsumexp(logits, -1, keepdim=True)
    sharp = logits / GREEDY_RANK_TEMPERATURE
    log_prior = top.values / GREEDY_RANK_TEMPERATURE - torch.logsumexp(sharp, -1, keepdim=True)
    return top.indices, log_q, log_prior


def draft_logits(model, x: Tensor, input_pos: Tensor, slots: Optional[Tensor], mask: Optional[Tensor],
                 last: bool) -> Tensor:
    """Draft logits over x [B, T]: of each row's last query [B, V] if `last`, else of every query [B * T, V]."""
    logits = model(x, input_pos, slots, mask)  # [B, T, V]
    return logits[:, -1] if last else logits.flatten(0, 1)


def draft_chain(model, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int):
    """`depth` draft tokens, each fed back as the next query, in one graph; x, input_pos [B, T]. Returns the tokens
    [B, depth] and, at temperature > 0, the distributions they were drawn from [B, depth, V] (else None)."""
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
    """How likely the verifier is to accept a drafted tree node, learned while generating (Sequoia-style).
    A child's cell (sibling rank, bucket of q, bucket of the prior) estimates, with decaying counts,
    P(accept | parent reached) = (accepted + w * prior) / (reached + w); a node scores the log-estimates on its path."""
    LOG_Q_EDGES = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, -0.2)
    PRIOR_EDGES = (0.05, 0.15, 0.3, 0.5, 0.7, 0.85, 0.95)
    PRIOR_WEIGHT = 4.0  # w: the prior counts as this many observations
    DECAY = 0.98  # per verification step

    LOOKUP_PRIOR = 0.5  # a looked-up child's prior: this times its share of the lookups

    def __init__(self, width: int):
        self.cells_per_rank = (len(self.LOG_Q_EDGES) + 1) * (len(self.PRIOR_EDGES) + 1)
        self.lookup_cells = width * self.cells_per_rank  # then one cell per PRIOR_EDGES bucket
        self.reached = [0.0] * (self.lookup_cells + len(self.PRIOR_EDGES) + 1)
        self.accepted = [0.0] * len(self.reached)
        self.unit = 1.0  # what one observation counts now

    def rank(self, tokens: Tensor, log_q: Tensor, log_prior: Tensor, keep: Optional[Tensor] = None,
             falling: bool = False) -> list:
        """Score candidates [rows, width] (most probable first): [[(token, log-estimate, cell)]] for those in `keep`
        (default: prior > 0). falling: scores never rise along a row."""
        scores, cells = table_estimates(log_q.cpu(), log_prior.cpu(), *self.counts())
        prior = log_prior.double().cpu().exp()
        if falling:
            scores = scores.cummin(-1).values
        keep = (prior > 0) if keep is None else keep.cpu()
        return [[(t, s, c) for t, s, c, k in zip(*row) if k]
                for row in zip(tokens.tolist(), scores.tolist(), cells.tolist(), keep.tolist())]

    def counts(self):
        """(accepted, reached, w) as float64 tensors; w has 1 element, since a 0-d one costs dynamo a retrace."""
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
    """Log-estimates and cells [rows, width] from AcceptanceTable.counts(), in a graph or on the host; prior 0: -inf."""
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
    """`width` draws without replacement from each row of q [rows, V] by Gumbel-top-k (Kool et al. 2019), the log of
    q's `width` largest probabilities, and the i-th draw's log prior p_i / (mass not ranked above); [rows, width]."""
    keys = q.log() - exponential_like(q).log()  # log q + Gumbel noise
    drawn = torch.topk(keys, width, dim=-1).indices
    top = torch.topk(q, width, dim=-1).values.double()
    left = 1.0 - (top.cumsum(-1) - top)
    return drawn, top.log(), (top / left.clamp_min(1e-30)).clamp_max(1.0).log()


def tree_children(logits: Tensor, sampling: Sampling, width: int, accepted: Tensor, reached: Tensor, weight: Tensor):
    """Children of each row of logits [rows, V]: tokens, log-estimates, cells [rows, width] (greedy: most probable
    first; sampled: in draw order, scores falling) and q [rows, V] (None at temperature 0)."""
    if sampling.temperature == 0:
        tokens, log_q, log_prior = greedy_candidates(logits, width)
        return (tokens, *table_estimates(log_q, log_prior, accepted, reached, weight), None)
    q = logits_to_probs(logits, sampling)
    tokens, log_top, log_prior = sampled_candidates(q, width)
    scores, cells = table_estimates(log_top, log_prior, accepted, reached, weight)
    return tokens, scores.cummin(-1).values, cells, q


def tree_root(model, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int, width: int, accepted: Tensor,
              reached: Tensor, weight: Tensor):
    """draft_tree's first forward: the root's children in the [B, M] buffers tree_depth() fills (scores with an
    extra -inf column for padding), newest [B, width^2], seen [B, width, span] and qs [B, R, V] (None if greedy)."""
    batch, device = x.shape[0], x.device
    span = max(depth - 1, 1) * width  # draft-cache slots after the root where frontier nodes are read
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
    if q is not None:  # the root's q, then each frontier node's [B, 1 + (K - 1) * width, V]
        qs = torch.cat([q.unsqueeze(1), q.new_zeros(batch, (depth - 1) * width, q.shape[-1])], 1)
    return all_tokens, all_parents, all_cells, all_scores, rows, slots, newest, seen, qs


def tree_depth(model, state: tuple, d: Tensor, pos: Tensor, sampling: Sampling, width: int, accepted: Tensor,
               reached: Tensor, weight: Tensor):
    """One later forward of draft_tree: give the `width` best newest candidates (stable sort; padding scores -inf)
    `width` children each. d [1]: the depth expanded."""
    all_tokens, all_parents, all_cells, all_scores, rows, slots, newest, seen, qs = state
    batch, device = all_tokens.shape[0], all_tokens.device
    span = seen.shape[-1]
    order = torch.sort(all_scores.gather(1, newest), dim=-1, descending=True, stable=True).indices[:, :width]
    frontier = newest.gather(1, order)  # [B, width]
    first = (d - 1) * width  # [1]: the frontier's first slot after the root, minus one
    read_at = pos + 1 + first + torch.arange(width, device=device)  # [B, width]
    slots = slots.scatter(1, frontier, read_at)
    parent = order // width  # its parent's place in the last frontier
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


def draft_tree(root, step, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int, width: int, accepted: Tensor,
               reached: Tensor, weight: Tensor):
    """Every row's tree with no host sync, as ModelDrafter.draft grows it without lookups: tree_root(), then
    tree_depth() per depth on fixed-shape buffers (two graphs whatever K). x, input_pos [B, 2]: the token before
    the root and the root. Returns the non-root candidates best first [B, M - 1], M = 1 + width + (K - 1) * width^2;
    per candidate [B, 6, M]: token, parent, cell, draft slot, usable (prior > 0), row of qs; and qs (None if greedy)."""
    state = root(x, input_pos, sampling, depth, width, accepted, reached, weight)
    pos = input_pos[:, -1:]  # [B, 1] the root's slot
    depths = torch.arange(depth, device=x.device)  # the depth as a tensor: one graph serves every depth
    for d in range(1, depth):
        state = step(state, depths[d:d + 1], pos, sampling, width, accepted, reached, weight)
    all_tokens, all_parents, all_cells, all_scores, rows, slots, _, _, qs = state
    size = all_tokens.shape[1]
    ranked = torch.sort(all_scores[:, 1:size], dim=-1, descending=True, stable=True).indices + 1  # [B, M - 1]
    nodes = torch.stack([all_tokens, all_parents, all_cells, slots, (all_scores[:, :size] > -math.inf).long(), rows],
                        1)  # [B, 6, M]
    return ranked, nodes, qs


class ModelDrafter:
    """A draft model grows an EAGLE-2-style dynamic tree, one depth per forward: the `width` best newest nodes get
    `width` children each (greedy: the most probable; sampled: drawn without replacement from the warped q), and
    the tree_nodes best by acceptance-table score are kept. Width 1 is the classic chain."""
    features = ()  # reads no target features

    def __init__(self, engine: Engine, depth: int, tree_nodes: int, auto_depth: bool = False, ngram: int = 0):
        self.engine, self.draft_model = engine, engine.model
        self.depth, self.tree_nodes = depth, tree_nodes
        self.device = self.draft_model.tok_embeddings.weight.device
        self.lookup = Lookup(ngram) if ngram else None  # n-gram branches merged into the tree
        self.lookups = []  # one per row, sharing self.lookup's earlier samples
        self.width = tree_width(depth, tree_nodes)
        self.lookahead = max(tree_nodes, (depth - 1) * self.width) + 2
        forward = engine.forward  # a regional engine's shared compiled block
        self.propose = engine.compile(draft_candidates) or functools.partial(draft_candidates, forward)
        self.compute_logits = engine.compile(draft_logits) or functools.partial(draft_logits, forward)
        self.run_chain = engine.compile(draft_chain) if self.width == 1 and not auto_depth else None
        root, step = engine.compile(tree_root), engine.compile(tree_depth)
        self.grow_tree = functools.partial(draft_tree, root, step) if root and self.width > 1 and not ngram else None
        self.table = AcceptanceTable(self.width)  # kept across the samples of one run
        self.pending = []  # per row: accepted tokens not yet in the draft's cache
        self.caught_up = 0.0  # draft(): when it had read the tokens accepted since its last draft, if any

    @property
    def kind(self) -> str:
        """For the stats: a chain ("draft") or a token tree."""
        return "draft" if self.width == 1 else "tree"

    def start(self, prompts: list, max_seq_length: int, features=None) -> int:
        self.draft_model.setup_caches(len(prompts), max_seq_length)
        # the prompts are read at the first draft, with the tokens of any plain steps before it (`auto`): a
        # generation that never drafts never pays the draft's prefill
        self.pending = [list(p) for p in prompts]
        self.lookups = [self.lookup.fresh() for _ in prompts] if self.lookup else []
        return 0

    def finish(self, outs: list):
        if self.lookup:
            for out in outs:
                self.lookup.finish(out)

    def draft(self, roots: list, pos: list, depth: int, contexts: list, sampling: Sampling, nodes=None):
        """(nodes: its tree size is fixed by its compiled graphs: tree_nodes, whatever is asked.)"""
        device = self.device
        batch, forwards = len(roots), 0
        # accepted tokens the draft never read (all but the last) go into the cache first; shorter rows rewrite
        # tokens they already hold
        longest = max(len(p) for p in self.pending)
        if longest > 1:
            at = [[max(0, p - longest + j) for j in range(longest - 1)] for p in pos]  # [B, longest - 1]
            x = torch.tensor([[context[i] for i in row] for context, row in zip(contexts, at)], device=device)
            self.engine.write_cache(x, torch.tensor(at, device=device))
            forwards += 1
            self.caught_up = time.perf_counter()  # when the draft had read the accepted text (`auto`)
        # depth 1: each row's last pending token (or the one it holds there) and its root, under the causal mask
        if self.run_chain is not None and depth == self.depth:
            return self.draft_chain(roots, pos, contexts, sampling), forwards + depth
        if self.grow_tree is not None and depth == self.depth:
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
            # one forward over every row's frontier, each node seeing the prefix and its ancestors (a chain needs
            # only the causal mask)
            frontiers = [sorted(nodes, key=lambda i: -s[i])[: self.width] for nodes, s in zip(newest, scores)]
            base = [p + 1 + (d - 1) * self.width for p in pos]
            rows = []  # [B][width]: the frontier, padded with copies of its last node (the root if empty)
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
        """Every row's chain through the K-step graph (draft_chain), fed the token before the root (which the draft
        may not have read) and the root; the node at depth d < K sits at slot pos + d."""
        x = torch.tensor([context[-2:] for context in contexts], device=self.device)  # [B, 2]
        input_pos = torch.tensor(pos, device=self.device).view(-1, 1) + torch.arange(-1, 1, device=self.device)
        with sdpa_context():
            tokens, q = self.run_chain(x, input_pos, sampling, self.depth)  # [B, K], [B, K, V]
        q = q.clone() if q is not None else None  # a CUDA graph's next replay overwrites its outputs
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
        """Every row's tree through draft_tree (fed as draft_chain is), cut to the tree_nodes best as select() cuts."""
        x = torch.tensor([context[-2:] for context in contexts], device=self.device)  # [B, 2]
        input_pos = torch.tensor(pos, device=self.device).view(-1, 1) + torch.arange(-1, 1, device=self.device)
        with sdpa_context():
            ranked, nodes, qs = self.grow_tree(x, input_pos, sampling, self.depth, self.width,
                                          *self.table.counts())
        qs = qs.clone() if qs is not None else None  # a CUDA graph's next replay overwrites its outputs
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
        """One draft forward over x [B, T]: the children of each query (of each row's last if `last`), best first:
        [[(token, proposal, log-estimate, cell)]], proposal None if deterministic. `exclude`: tokens not to draw."""
        if self.width == 1 and x.shape[1] == 1:  # a chain step: the draft's one-token decode graph
            with sdpa_context():
                tokens, q = self.engine.decode_one_token(self.draft_model, x, input_pos, sampling)
            # copy q: a CUDA graph's next replay overwrites its outputs
            greedy = sampling.temperature == 0
            q = None if greedy else q.clone()
            return [[(token, None if greedy else q[r], 0.0, None)] for r, token in enumerate(tokens.tolist())]
        with sdpa_context():
            if sampling.temperature == 0 and self.width == 1:  # chain: the argmax, a point mass (no scores)
                tokens = self.compute_logits(x, input_pos, slots, mask, last).argmax(-1)
                return [[(token, None, 0.0, None)] for token in tokens.tolist()]
            if sampling.temperature == 0:
                tokens, log_q, log_prior = self.propose(x, input_pos, slots, mask, self.width, last)
                rows = self.table.rank(tokens, log_q, log_prior)
                return [[(token, None, score, cell) for token, score, cell in row] for row in rows]
            logits = self.compute_logits(x, input_pos, slots, mask, last)
        return self.sampled_children(logits, sampling, exclude)

    def sampled_children(self, logits: Tensor, sampling: Sampling, exclude=None) -> list:
        """Per row of logits [rows, V]: `width` children drawn without replacement (Gumbel-top-k) from the warped q
        minus the row's `exclude`, in draw order: [[(token, q, log-estimate, cell)]].
        Lossless only if a node's kept children are a prefix of its draws chosen without looking at them
        (verify()): so scores use only rank and q's sorted probabilities and fall along ranks and depth, and select()
        breaks ties by depth, then index."""
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
        """Merge the n-gram trie into the tree (as SpecInfer, Miao et al. 2023). Sampled: the best tree_nodes // 2
        looked-up children (point masses) outrank every drawn node, so draws never decide which of them survive."""
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
        """[1, 1, width, max_seq_length]: row j (slot base + j) sees the prefix, its ancestors' slots and its own."""
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
        return mask.view(1, 1, *mask.shape)  # on the host: draft() moves the batch's masks at once

    def select(self, tree: Tree, scores: list) -> Tree:
        """Keep the tree_nodes best nodes; ties go to the shallower, then earlier node, so the result is a tree."""
        drafted = range(1, len(tree.tokens))
        keep = sorted(drafted, key=lambda i: (-scores[i], tree.depths[i], i))[: self.tree_nodes]
        return tree.subtree(sorted(keep, key=lambda i: (tree.depths[i], i)))

    def accepted(self, paths: list, trees: list, pos: list, features=None):
        """Compact the draft's cache like the target's; accepted nodes it never read are fed next step."""
        rows, src, dst = [], [], []
        for b, (path, tree) in enumerate(zip(paths, trees)):
            if path is None:  # a finished row: nothing moves
                continue
            if tree.draft_slots[0] is None:  # a plain step (speculate.AutoChoice): the draft never read its root
                self.pending[b] = self.pending[b] + [tree.tokens[0]]
                continue
            if self.width > 1:
                self.table.observe(tree, path)
            fed = [node for node in path if tree.draft_slots[node] is not None]
            rows += [b] * len(fed)
            src += [tree.draft_slots[n] for n in fed]
            dst += range(pos[b] + 1, pos[b] + 1 + len(fed))
            self.pending[b] = [tree.tokens[n] for n in path[len(fed):]]
        move_cache_slots(self.draft_model, src, dst, rows)
