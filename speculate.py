"""Speculative decoding: draft sources, token-tree verification, KV-cache compaction, acceptance stats.

Every step drafts a token tree rooted at the current token, scores all of its nodes in ONE target
forward (tree attention: positions = prefix length + depth, each node sees the prefix and its own
ancestors), accepts a root-to-node path plus one token from the target, and moves the accepted
path's keys/values to contiguous cache slots. A chain (--tree_nodes == --speculate_k) is the tree
with one child per node; the n-gram drafter feeds the same verifier.
"""
import bisect
import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from generate import Engine, Sampling, UserError, logits_to_probs, sample, sample_from, sdpa_context

NO_PARENT = -2  # padding node: not part of the tree, never accepted
GREEDY_RANK_TEMPERATURE = 0.3  # sharpening of the draft's distribution when ranking tree nodes for greedy decoding


@dataclass
class Tree:
    """Root (index 0, the current token) plus drafted nodes, parents listed before children.
    proposals[i] is the distribution node i was sampled from, or None where the children were
    chosen deterministically (then the proposal is a point mass on the chosen token)."""
    tokens: list
    parents: list
    depths: list
    proposals: list

    def children(self):
        kids = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(node)
        return kids

    def pad_to(self, size: int):
        while len(self.tokens) < size:
            self.tokens.append(0)
            self.parents.append(NO_PARENT)
            self.depths.append(0)
            self.proposals.append(None)
        return self


def tree_mask(parents: list, start: int, max_seq_length: int, device) -> Tensor:
    """[1, 1, n, max_seq_length] bool: node i at slot start+i sees slots < start and its ancestors."""
    n = len(parents)
    sees = []  # sees[i][j]: node i attends to node j
    for i, parent in enumerate(parents):
        row = list(sees[parent]) if parent >= 0 else [False] * n
        row[i] = True
        sees.append(row)
    mask = torch.zeros(n, max_seq_length, dtype=torch.bool)
    mask[:, :start] = True
    mask[:, start:start + n] = torch.tensor(sees)
    return mask.view(1, 1, n, max_seq_length).to(device)


def verify(tree: Tree, target_probs: Tensor):
    """Pick the accepted path and the next token; lossless for any drafter.

    Multi-candidate speculative sampling (SpecInfer, Miao et al. 2023; one child per node is the
    rule of Leviathan et al. 2023 / Chen et al. 2023): at a node with target distribution p, try its
    children in order; child x drawn from proposal q is accepted with probability min(1, p(x)/q(x)),
    else p becomes the residual norm(max(0, p - q)) before the next sibling is tried. A child chosen
    deterministically has q = point mass on x: accepted with probability p(x), residual = p without x
    (the without-replacement variant). With temperature 0, p is one-hot and this is exact argmax
    matching. If no child is accepted the next token is sampled from the last residual."""
    kids = tree.children()
    node, path = 0, []
    while True:
        p = target_probs[node]
        accepted = None
        for child in kids[node]:
            x = tree.tokens[child]
            q = tree.proposals[child]
            ratio = p[x] / q[x] if q is not None else p[x]
            if torch.rand((), device=p.device) < ratio:
                accepted = child
                break
            p = residual(p, q, x)
        if accepted is None:
            return path, int(sample_from(p))
        path.append(accepted)
        node = accepted


def verify_greedy(tree: Tree, argmax: list):
    """verify() at temperature 0, where p is one-hot: follow the children that equal the target's argmax
    (the longest matching root-to-node path), then take the target's argmax as the next token."""
    kids = tree.children()
    node, path = 0, []
    while True:
        match = next((child for child in kids[node] if tree.tokens[child] == argmax[node]), None)
        if match is None:
            return path, argmax[node]
        path.append(match)
        node = match


def residual(p: Tensor, q: Optional[Tensor], x: int) -> Tensor:
    """norm(max(0, p - q)): what the target still owes after rejecting x drawn from q (q=None: point mass)."""
    rest = (p - q).clamp_min(0) if q is not None else p.index_fill(0, torch.tensor([x], device=p.device), 0)
    total = rest.sum()
    return rest / total if total > 0 else p


def move_cache_slots(model, src: list, dst: list):
    """Copy keys/values of cache slots src -> dst (every layer, every row); gather before writing."""
    pairs = [(s, d) for s, d in zip(src, dst) if s != d]
    if not pairs:
        return
    device = model.tok_embeddings.weight.device
    src_t = torch.tensor([s for s, _ in pairs], device=device)
    dst_t = torch.tensor([d for _, d in pairs], device=device)
    for layer in model.layers:
        cache = layer.attention.kv_cache
        cache.k_cache[:, :, dst_t] = cache.k_cache[:, :, src_t]
        cache.v_cache[:, :, dst_t] = cache.v_cache[:, :, src_t]


class TreeSpeculator:
    """The generation loop shared by every drafter: draft a tree, verify, compact, repeat."""
    kind = "tree"

    def __init__(self, depth: int, tree_nodes: int, auto_depth: bool = False):
        self.depth, self.tree_nodes, self.auto_depth = depth, tree_nodes, auto_depth
        self.lookahead = tree_nodes + 2
        self.reset_stats()

    def reset_stats(self):
        self.accept_counts = [0] * (self.depth + 1)
        self.target_forwards = 0
        self.draft_forwards = 0
        self.drafted = 0

    def compile(self, device):
        pass

    def generate(self, target: Engine, prompt: Tensor, first: Tensor, max_new_tokens: int, sampling: Sampling,
                 eos_ids: list, stop_at_eos: bool, callback=None):
        self.reset_stats()
        self.target_forwards = 1  # the prefill
        model, device = target.model, prompt.device
        eos = set(eos_ids)
        pos = prompt.numel()  # slot of the current (last accepted, not yet cached) token
        history = prompt.tolist()
        out = [int(first[0])]
        if callback:
            callback(first)
        self.start(prompt, model.max_seq_length)
        depth = self.depth if not self.auto_depth else min(2, self.depth)
        while len(out) < max_new_tokens and not (stop_at_eos and out[-1] in eos):
            tree = self.draft(out[-1], pos, depth, history + out, sampling)
            tree.pad_to(self.tree_nodes + 1)
            n = len(tree.tokens)
            tokens = torch.tensor([tree.tokens], device=device)
            input_pos = torch.tensor([[pos + d for d in tree.depths]], device=device)
            slots = torch.arange(pos, pos + n, device=device).view(1, -1)
            mask = tree_mask(tree.parents, pos, model.max_seq_length, device)
            with sdpa_context():
                logits = target.forward(tokens, input_pos, slots, mask)
            self.target_forwards += 1
            if sampling.temperature == 0:
                path, next_token = verify_greedy(tree, logits[0].argmax(-1).tolist())
            else:
                path, next_token = verify(tree, logits_to_probs(logits[0], sampling))
            move_cache_slots(model, [pos + node for node in path], list(range(pos + 1, pos + 1 + len(path))))
            self.accepted(path, tree, pos)
            self.accept_counts[len(path)] += 1
            self.drafted += depth
            new = [tree.tokens[node] for node in path] + [next_token]
            if self.auto_depth:  # grow after a fully accepted chain, shrink after a rejection
                depth = min(self.depth, depth + 2) if len(path) == depth else max(1, depth - 1)
            pos += len(new)
            for t in new:
                if len(out) >= max_new_tokens or (stop_at_eos and out[-1] in eos):
                    break
                out.append(t)
                if callback:
                    callback(torch.tensor([t]))
        self.finish(out)
        return [out], self.summary()

    def summary(self) -> dict:
        steps = max(sum(self.accept_counts), 1)
        accepted = sum(i * c for i, c in enumerate(self.accept_counts))
        return {
            "accept_counts": list(self.accept_counts),
            "mean_accepted": accepted / steps,
            "acceptance_rate": accepted / max(self.drafted, 1),
            "tokens_per_target_forward": (accepted + steps) / steps,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "speculate_k": self.depth, "tree_nodes": self.tree_nodes,
        }

    # drafter hooks
    def start(self, prompt: Tensor, max_seq_length: int):
        pass

    def finish(self, tokens: list):
        pass

    def draft(self, root: int, pos: int, depth: int, context: list, sampling: Sampling) -> Tree:
        raise NotImplementedError

    def accepted(self, path: list, tree: Tree, pos: int):
        pass


def greedy_candidates(logits: Tensor, width: int):
    """The `width` largest logits of each row [rows, V]: token ids, their log q (the draft's
    distribution) and their log prior (q sharpened by GREEDY_RANK_TEMPERATURE), each [rows, width]."""
    logits = logits.float()
    top = torch.topk(logits, width, dim=-1)
    log_q = top.values - torch.logsumexp(logits, -1, keepdim=True)
    sharp = logits / GREEDY_RANK_TEMPERATURE
    log_prior = top.values / GREEDY_RANK_TEMPERATURE - torch.logsumexp(sharp, -1, keepdim=True)
    return top.indices, log_q, log_prior


def draft_candidates(model, x: Tensor, input_pos: Tensor, slots: Optional[Tensor], mask: Optional[Tensor],
                     width: int):
    """A draft forward and greedy_candidates() of its logits, in one graph when compiled."""
    return greedy_candidates(model(x, input_pos, slots, mask)[0], width)


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

    def children(self, logits: Tensor, sampling: Sampling, width: int) -> list:
        """The `width` most probable children of each row of logits [rows, V], chosen deterministically:
        [[(token, log-estimate, cell)]], zero-probability children left out."""
        if sampling.temperature > 0:  # verify() accepts a deterministic child x with probability p(x) ~ q(x)
            top = torch.topk(logits_to_probs(logits, sampling), width, dim=-1)
            log_q = top.values.clamp_min(1e-30).log().tolist()
            return self.rank(top.indices.tolist(), log_q, log_q)
        return self.rank(*(t.tolist() for t in greedy_candidates(logits, width)))

    def rank(self, tokens: list, log_q: list, log_prior: list) -> list:
        """Score each row's candidates (lists [rows][width], most probable first)."""
        rows = []
        for row_tokens, row_log_q, row_log_prior in zip(tokens, log_q, log_prior):
            row = []
            for rank, (token, lq, lp) in enumerate(zip(row_tokens, row_log_q, row_log_prior)):
                prior = math.exp(lp)
                if prior == 0:
                    continue
                cell = (rank * (len(self.LOG_Q_EDGES) + 1) + bisect.bisect(self.LOG_Q_EDGES, lq)) \
                    * (len(self.PRIOR_EDGES) + 1) + bisect.bisect(self.PRIOR_EDGES, prior)
                estimate = self.estimate(cell, prior)
                row.append((token, math.log(min(max(estimate, 1e-12), 1.0)), cell))
            rows.append(row)
        return rows

    def lookup(self, share: float):
        """(log-estimate, cell) of a child that continues `share` of the n-gram lookup's occurrences."""
        prior = self.LOOKUP_PRIOR * share
        cell = self.lookup_cells + bisect.bisect(self.PRIOR_EDGES, prior)
        return math.log(min(max(self.estimate(cell, prior), 1e-12), 1.0)), cell

    def estimate(self, cell: int, prior: float) -> float:
        weight = self.PRIOR_WEIGHT * self.unit
        return (self.accepted[cell] + weight * prior) / (self.reached[cell] + weight)

    def observe(self, tree: Tree, cells: list, path: list):
        """The verifier reached the root and every accepted node, and accepted the nodes on the path."""
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


class DraftModelSpeculator(TreeSpeculator):
    """A small draft model grows the tree one depth per forward (EAGLE-2 style dynamic tree):
    expand the `width` best-scored nodes of the newest depth, give each its `width` most probable
    children, and keep the tree_nodes best nodes overall, a node's score being the acceptance table's
    log-estimate summed along its path (with --draft_ngram, the lookup's branches are merged in first).
    With width 1 (tree_nodes == depth) this is the classic chain, and at temperature > 0 each
    child is *sampled* from the draft's warped distribution, which is then the q of verify()."""
    kind = "draft"

    def __init__(self, draft_model, depth: int, tree_nodes: int, auto_depth: bool = False, ngram: int = 0):
        super().__init__(depth, tree_nodes, auto_depth)
        self.draft_model = draft_model
        self.lookup = Lookup(ngram) if ngram else None  # n-gram branches merged into the draft's tree
        self.kind = "draft" if tree_nodes == depth else "tree"  # stats: a chain, or token-tree verification
        self.width = 1 if tree_nodes == depth else min(8, max(2, math.ceil(tree_nodes / depth)))
        self.lookahead = max(tree_nodes, (depth - 1) * self.width) + 2
        self.engine = Engine(draft_model)
        self.candidates = draft_candidates
        self.write_cache = draft_model
        self.table = AcceptanceTable(self.width)  # kept across the samples of one run

    def compile(self, device):
        from generate import compile_engine
        self.engine = compile_engine(self.draft_model, device, compile_prefill=True)
        mode = "reduce-overhead" if device.startswith("cuda") else None
        self.candidates = torch.compile(draft_candidates, mode=mode, fullgraph=True, dynamic=False)
        self.write_cache = torch.compile(self.draft_model, fullgraph=True, dynamic=True)

    def start(self, prompt: Tensor, max_seq_length: int):
        self.draft_model.setup_caches(1, max_seq_length)
        input_pos = torch.arange(prompt.numel(), device=prompt.device).view(1, -1)
        with sdpa_context():
            self.engine.prefill(self.draft_model, prompt.view(1, -1), input_pos, Sampling())
        self.draft_forwards += 1
        self.pending = []  # accepted tokens not yet in the draft's cache (before the root)
        if self.lookup:
            self.lookup.start()

    def finish(self, tokens: list):
        if self.lookup:
            self.lookup.finish(tokens)

    def draft(self, root: int, pos: int, depth: int, context: list, sampling: Sampling) -> Tree:
        device = self.draft_model.tok_embeddings.weight.device
        # depth 1: catch up on the pending token (if any) and read the root's distribution
        if len(self.pending) > 1:  # accepted looked-up tokens: all but the last go in first (any length)
            start = pos - len(self.pending)
            x = torch.tensor([self.pending[:-1]], device=device)
            with sdpa_context():
                self.write_cache(x, torch.arange(start, pos - 1, device=device).view(1, -1))
            self.draft_forwards += 1
            self.pending = self.pending[-1:]
        feed = self.pending + [root]
        x = torch.tensor([feed], device=device)
        input_pos = torch.arange(pos - len(self.pending), pos + 1, device=device).view(1, -1)
        children = self.read(x, input_pos, None, None, sampling)[-1:]
        self.pending = []
        tree = Tree([root], [-1], [0], [None])
        self.draft_slot = {0: pos}
        self.cells = [None]  # per drafted node: its acceptance-table cell (trees only)
        frontier = [0]
        scores = [0.0]
        for d in range(1, depth + 1):
            newest = []
            for parent, kids in zip(frontier, children):
                for token, proposal, logp, cell in kids:
                    tree.tokens.append(token)
                    tree.parents.append(parent)
                    tree.depths.append(d)
                    tree.proposals.append(proposal)
                    self.cells.append(cell)
                    scores.append(scores[parent] + logp)
                    newest.append(len(tree.tokens) - 1)
            if d == depth:
                break
            frontier = sorted(newest, key=lambda i: -scores[i])[: self.width]
            # one forward over the whole frontier, each node seeing the prefix and its ancestors
            base = pos + 1 + (d - 1) * self.width
            for j, node in enumerate(frontier):
                self.draft_slot[node] = base + j
            # a chain sits at consecutive slots (slot = position): the default causal mask is its tree mask
            slots = mask = None
            rows = frontier
            if self.width > 1:
                rows = frontier + frontier[-1:] * (self.width - len(frontier))  # one static shape: pad with copies
                mask = self.frontier_mask(tree, rows, pos, base)
                slots = torch.arange(base, base + self.width, device=device).view(1, -1)
            x = torch.tensor([[tree.tokens[n] for n in rows]], device=device)
            input_pos = torch.full((1, len(rows)), pos + d, device=device)
            children = self.read(x, input_pos, slots, mask, sampling)[:len(frontier)]
        if self.lookup:
            self.merge(tree, scores, self.lookup.trie(context, depth))
        return self.select(tree, scores)

    def merge(self, tree: Tree, scores: list, trie: dict):
        """Merge the n-gram lookup's trie into the draft's tree (SpecInfer, Miao et al. 2023, merges the
        token trees of several speculators into one): a looked-up child the draft also proposed keeps its
        node, with the better score; the others become new nodes, scored by the table's lookup cells."""
        child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p >= 0}
        stack = [(0, trie)]
        while stack:
            parent, level = stack.pop()
            total = sum(count for count, _ in level.values())
            for token, (count, below) in level.items():
                score, cell = self.table.lookup(count / total)
                node = child.get((parent, token))
                if node is None:
                    node = len(tree.tokens)
                    tree.tokens.append(token)
                    tree.parents.append(parent)
                    tree.depths.append(tree.depths[parent] + 1)
                    tree.proposals.append(None)
                    self.cells.append(cell)
                    scores.append(scores[parent] + score)
                else:
                    scores[node] = max(scores[node], scores[parent] + score)
                if below:
                    stack.append((node, below))

    def read(self, x: Tensor, input_pos: Tensor, slots, mask, sampling: Sampling) -> list:
        """One draft forward; the children of each row of x: [[(token, proposal or None, score, cell)]]."""
        self.draft_forwards += 1
        with sdpa_context():
            if sampling.temperature == 0:
                tokens, log_q, log_prior = self.candidates(self.draft_model, x, input_pos, slots, mask, self.width)
                if self.width == 1:  # chain: the argmax, a point-mass proposal
                    return [[(token, None, 0.0, None)] for token in tokens[:, 0].tolist()]
                rows = self.table.rank(tokens.tolist(), log_q.tolist(), log_prior.tolist())
            else:
                logits = self.engine.forward(x, input_pos, slots, mask)[0]
                if self.width == 1:
                    return [[(*child, None) for child in self.choose_children(row, sampling)] for row in logits]
                rows = self.table.children(logits, sampling, self.width)
        return [[(token, None, score, cell) for token, score, cell in row] for row in rows]  # deterministic

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
                cols.append(self.draft_slot[node])
                node = tree.parents[node]
        mask = torch.zeros(len(frontier), self.draft_model.max_seq_length, dtype=torch.bool)
        mask[:, : pos + 1] = True
        mask[rows, cols] = True
        return mask.view(1, 1, *mask.shape).to(self.draft_model.tok_embeddings.weight.device)

    def choose_children(self, logits: Tensor, sampling: Sampling):
        """Chain at temperature > 0: [(token sampled from q, q, score)]."""
        token, q = sample(logits.view(1, -1), sampling)
        return [(int(token[0]), q[0], 0.0)]

    def select(self, tree: Tree, scores: list) -> Tree:
        """Keep the tree_nodes best nodes; a child never outranks its parent, so the result is a tree."""
        drafted = range(1, len(tree.tokens))
        keep = sorted(drafted, key=lambda i: (-scores[i], tree.depths[i], i))[: self.tree_nodes]
        keep = sorted(keep, key=lambda i: (tree.depths[i], i))
        index = {0: 0}
        out = Tree([tree.tokens[0]], [-1], [0], [None])
        for i in keep:
            index[i] = len(out.tokens)
            out.tokens.append(tree.tokens[i])
            out.parents.append(index[tree.parents[i]])
            out.depths.append(tree.depths[i])
            out.proposals.append(tree.proposals[i])
        self.kept_draft_slot = {index[i]: s for i, s in self.draft_slot.items() if i in index}
        self.kept_cells = [self.cells[i] for i in [0] + keep]
        return out

    def accepted(self, path: list, tree: Tree, pos: int):
        """Compact the draft's cache like the target's; a last accepted node the draft never consumed
        is fed at the start of the next step. Trees also record which nodes were accepted."""
        if self.width > 1:
            self.table.observe(tree, self.kept_cells, path)
        fed = [node for node in path if node in self.kept_draft_slot]
        move_cache_slots(self.draft_model, [self.kept_draft_slot[n] for n in fed],
                         list(range(pos + 1, pos + 1 + len(fed))))
        self.pending = [tree.tokens[n] for n in path[len(fed):]]


class Lookup:
    """Draft-free drafting (Lookahead, Zhao et al. 2023): continuations of the current suffix found
    earlier in the context (prompt and output) and in the earlier samples of the run, merged into a trie.
    Every 1..n-1-gram's occurrences are indexed as the text grows, so a lookup scans nothing."""

    def __init__(self, n: int):
        self.n = n
        self.in_samples = {}  # gram (tuple) -> [(an earlier sample's ids, index just after the gram)]
        self.start()

    def start(self):
        """A new generation: forget the previous context (its sample stays, through finish())."""
        self.context, self.in_context = [], {}

    def index(self, where: dict, text: list, start: int):
        for end in range(start + 1, len(text) + 1):
            for size in range(1, min(self.n - 1, end) + 1):
                where.setdefault(tuple(text[end - size:end]), []).append((text, end))

    def finish(self, tokens: list):
        self.index(self.in_samples, list(tokens), 0)

    def trie(self, context: list, depth: int) -> dict:
        """token -> [count, subtrie]: up to `depth` tokens after each occurrence of the longest suffix of
        context (n - 1 tokens, backing off to shorter ones) that occurred before."""
        grown = len(self.context)
        self.context.extend(context[grown:])
        self.index(self.in_context, self.context, grown)
        for size in range(min(self.n - 1, len(context)), 0, -1):
            gram = tuple(context[-size:])
            trie = {}
            for text, end in self.in_context.get(gram, []) + self.in_samples.get(gram, []):
                node = trie
                for t in text[end:end + depth]:
                    entry = node.setdefault(t, [0, {}])
                    entry[0] += 1
                    node = entry[1]
            if trie:
                return trie
        return {}


class NgramSpeculator(TreeSpeculator):
    """The lookup trie's most frequent branches become the tree. Children are chosen deterministically."""
    kind = "ngram"

    def __init__(self, n: int, depth: int, tree_nodes: int):
        super().__init__(depth, tree_nodes)
        self.lookup = Lookup(n)

    def start(self, prompt: Tensor, max_seq_length: int):
        self.lookup.start()

    def draft(self, root: int, pos: int, depth: int, context: list, sampling: Sampling) -> Tree:
        return self.best_first(root, self.lookup.trie(context, depth))

    def best_first(self, root: int, trie: dict) -> Tree:
        tree = Tree([root], [-1], [0], [None])
        frontier = [(-count, 1, token, sub, 0) for token, (count, sub) in trie.items()]
        while frontier and len(tree.tokens) <= self.tree_nodes:
            frontier.sort(key=lambda f: (f[0], f[1]))
            neg, depth, token, sub, parent = frontier.pop(0)
            tree.tokens.append(token)
            tree.parents.append(parent)
            tree.depths.append(depth)
            tree.proposals.append(None)
            me = len(tree.tokens) - 1
            frontier += [(-c, depth + 1, t, s, me) for t, (c, s) in sub.items()]
        return tree

    def finish(self, tokens: list):
        self.lookup.finish(tokens)


def check_same_vocabulary(target, draft, tokenizer, args):
    if target.args.vocab_size != draft.args.vocab_size:
        raise UserError(
            f"draft vocabulary ({draft.args.vocab_size} tokens, {args.draft_checkpoint_path}) differs from the "
            f"target's ({target.args.vocab_size}, {args.checkpoint_path}): pick a draft from the same model family")
    from tokenizer import get_tokenizer
    try:
        draft_tokenizer = get_tokenizer(args.draft_checkpoint_path.parent)
    except FileNotFoundError:
        return
    probe = "def main():\n    return 42  # The quick brown fox"
    if draft_tokenizer.encode(probe) != tokenizer.encode(probe):
        raise UserError("the draft's tokenizer differs from the target's: pick a draft from the same model family")


def make_drafter(args, draft_model, device) -> Optional[TreeSpeculator]:
    auto = args.speculate_k == "auto"
    depth = 8 if auto else int(args.speculate_k)
    if draft_model is None and not args.draft_ngram:
        if args.tree_nodes is not None:
            raise UserError("--tree_nodes needs a draft: add --draft_checkpoint_path or --draft_ngram N")
        return None
    nodes = args.tree_nodes if args.tree_nodes is not None else depth
    if nodes < depth:
        raise UserError(f"--tree_nodes ({nodes}) must be >= --speculate_k ({depth}): a tree holds at least one chain")
    if auto and nodes != depth:
        raise UserError("--speculate_k auto adapts a chain: drop --tree_nodes")
    if args.draft_ngram and args.draft_ngram < 2:
        raise UserError("--draft_ngram N needs N >= 2 (N - 1 tokens of context find the continuation)")
    if nodes > depth and getattr(args, "temperature", 0) > 0:
        print("note: at --temperature > 0 a tree's extra children are deterministic picks, which usually accept "
              "less than a chain's sampled drafts; for sampling, --tree_nodes equal to --speculate_k is faster",
              file=sys.stderr)
    if args.draft_ngram and draft_model is None:
        return NgramSpeculator(args.draft_ngram, depth, nodes)
    if args.draft_ngram and nodes == depth:
        raise UserError("--draft_ngram with a draft model merges lookups into the draft's tree: "
                        "add --tree_nodes N > --speculate_k")
    return DraftModelSpeculator(draft_model, depth, nodes, auto, args.draft_ngram or 0)


def format_stats(stats: dict) -> str:
    return (f"Acceptance: mean accepted {stats['mean_accepted']:.2f} of K={stats['speculate_k']} "
            f"(rate {stats['acceptance_rate']:.1%}, {stats['tokens_per_target_forward']:.2f} tokens per target "
            f"forward), accept_counts {stats['accept_counts']}, target forwards {stats['target_forwards']}, "
            f"draft forwards {stats['draft_forwards']}")
