"""Speculative decoding: draft sources, token-tree verification, KV-cache compaction, acceptance stats.

Every step drafts a token tree rooted at the current token, scores all of its nodes in ONE target
forward (tree attention: positions = prefix length + depth, each node sees the prefix and its own
ancestors), accepts a root-to-node path plus one token from the target, and moves the accepted
path's keys/values to contiguous cache slots. A chain (--tree_nodes == --speculate_k) is the tree
with one child per node; the n-gram drafter feeds the same verifier.
"""
import bisect
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from decode import (Engine, Sampling, compile_engine, compiled_region, decode_n_tokens, decode_one_token,
                    exponential_like, logits_to_probs, run_block, sample_from, sdpa_context, whole_graph_mode)
from model import UserError

NO_PARENT = -2  # padding node: not part of the tree, never accepted
GREEDY_RANK_TEMPERATURE = 0.3  # sharpening of the draft's distribution when ranking tree nodes for greedy decoding
AUTO_PROBE_STEPS = 2  # --speculate_k auto: speculative steps timed against a plain step before choosing


def synchronize(model):
    """Wait for the model's device (timing only; CPU work is already done)."""
    if model.tok_embeddings.weight.device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Tree:
    """Root (index 0, the current token) plus drafted nodes, parents listed before children.
    proposals[i] is the distribution node i was sampled from, or None where it was chosen deterministically
    (then its proposal is a point mass on the chosen token). cells[i] is node i's acceptance-table cell
    (None: not scored), draft_slots[i] the draft-cache slot holding its keys/values (None: never read)."""
    tokens: list = field(default_factory=list)
    parents: list = field(default_factory=list)
    depths: list = field(default_factory=list)
    proposals: list = field(default_factory=list)
    cells: list = field(default_factory=list)
    draft_slots: list = field(default_factory=list)

    @classmethod
    def rooted_at(cls, token: int, slot=None) -> "Tree":
        return cls([token], [-1], [0], [None], [None], [slot])

    def add(self, token: int, parent: int, proposal: Optional[Tensor] = None, cell=None) -> int:
        """Append a child of `parent`; returns its index."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self.proposals.append(proposal)
        self.cells.append(cell)
        self.draft_slots.append(None)
        return len(self.tokens) - 1

    def children(self):
        kids = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(node)
        return kids

    def subtree(self, keep: list) -> "Tree":
        """The root and the nodes `keep` (each one's parent kept too), in the order given, renumbered."""
        index = {0: 0}
        out = Tree.rooted_at(self.tokens[0], self.draft_slots[0])
        for i in keep:
            index[i] = out.add(self.tokens[i], index[self.parents[i]], self.proposals[i], self.cells[i])
            out.draft_slots[index[i]] = self.draft_slots[i]
        return out

    def pad_to(self, size: int) -> "Tree":
        while len(self.tokens) < size:  # padding nodes: never anyone's child, never accepted
            self.add(0, -1)
            self.parents[-1] = NO_PARENT
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

    Multi-candidate speculative sampling, children tried one after another (one child per node is the
    rule of Leviathan et al. 2023 / Chen et al. 2023; several are SpecInfer's, Miao et al. 2023, in its
    without-replacement form: recursive rejection sampling, Jeon et al. 2024, as in Sequoia, Chen et al.
    2024, section 3.2). At a node with target distribution p_1 = p, the i-th child x_i comes with the
    distribution it was drawn from; q_i is that distribution with the earlier siblings' tokens removed
    and renormalized (siblings are drawn without replacement). x_i is accepted with probability
    min(1, p_i(x_i) / q_i(x_i)); otherwise p_{i+1} = norm(max(0, p_i - q_i)) and the next sibling is
    tried. If every child is rejected the next token is sampled from the last residual.

    Why it is exact: for any q_i, "accept x ~ q_i with probability min(1, p_i/q_i), else draw from
    norm(max(0, p_i - q_i))" outputs exactly p_i (Leviathan et al., appendix A.1); by induction from the
    last sibling back, what follows a rejection of x_i outputs exactly p_{i+1}, so the node outputs
    exactly p. This needs only that x_i is distributed as q_i given everything that decided x_i is in
    the tree: the drafter keeps a prefix of each node's draws, and decides it without looking at them
    (DraftModelSpeculator.select). A deterministic child has a point-mass proposal: accepted with
    probability p_i(x), residual p_i without x. At temperature 0 p is one-hot: exact argmax matching."""
    kids = tree.children()
    node, path = 0, []
    while True:
        p = target_probs[node]
        accepted, earlier = None, []
        for child in kids[node]:
            x = tree.tokens[child]
            q = without(tree.proposals[child], earlier)
            ratio = p[x] / q[x] if q is not None else p[x]
            if torch.rand((), device=p.device) < ratio:
                accepted = child
                break
            p = residual(p, q, x)
            earlier.append(x)
        if accepted is None:
            return path, int(sample_from(p))
        path.append(accepted)
        node = accepted


def without(q: Optional[Tensor], tokens: list) -> Optional[Tensor]:
    """q with `tokens` (earlier siblings, drawn before) removed and renormalized: the distribution of a
    draw without replacement after them. None (a deterministic child) stays None."""
    if q is None or not tokens:
        return q
    rest = q.index_fill(0, torch.tensor(tokens, device=q.device), 0)
    return rest / rest.sum()


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


def move_cache_slots(model, src: list, dst: list, rows: Optional[list] = None):
    """Copy keys/values of cache slots src -> dst (every layer) in batch row rows[i] (default: row 0);
    all reads happen before any write, so a path can move onto slots it is leaving."""
    moves = [(r, s, d) for r, s, d in zip(rows if rows is not None else [0] * len(src), src, dst) if s != d]
    if not moves:
        return
    device = model.tok_embeddings.weight.device
    row_t, src_t, dst_t = torch.tensor(moves, device=device).unbind(1)
    for layer in model.layers:
        cache = layer.attention.kv_cache
        cache.k_cache[row_t, :, dst_t] = cache.k_cache[row_t, :, src_t]  # [moves, H, D] per side
        cache.v_cache[row_t, :, dst_t] = cache.v_cache[row_t, :, src_t]


@dataclass
class Stats:
    """Acceptance figures of one generation."""
    depth: int
    tree_nodes: int
    accept_counts: list = None  # accept_counts[i]: verify steps that accepted i drafted tokens
    target_forwards: int = 1  # the prefill
    draft_forwards: int = 0
    drafted: int = 0  # depth drafted, summed over the steps
    plain_after: Optional[int] = None  # --speculate_k auto chose plain decoding after this many target forwards

    def __post_init__(self):
        self.accept_counts = [0] * (self.depth + 1)

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
            "speculate_k": self.depth, "tree_nodes": self.tree_nodes, "drafted": self.drafted,
            **({"plain_after_forwards": self.plain_after} if self.plain_after is not None else {}),
        }


def combine_stats(summaries: list) -> dict:
    """One Stats.summary() for several generations (the batches of a prompts file)."""
    total = Stats(summaries[0]["speculate_k"], summaries[0]["tree_nodes"], target_forwards=0)
    for summary in summaries:
        total.accept_counts = [a + b for a, b in zip(total.accept_counts, summary["accept_counts"])]
        total.target_forwards += summary["target_forwards"]
        total.draft_forwards += summary["draft_forwards"]
        total.drafted += summary["drafted"]
    return total.summary()


def verify_step(target: Engine, trees: list, pos: list, sampling: Sampling, active: Optional[list] = None) -> list:
    """One target forward over every row's tree (row b's node i at cache slot pos[b] + i, RoPE position
    pos[b] + depth, seeing the row's prefix and its ancestors), then verification of each active row, then
    each accepted path's keys/values moved to the slots right after its root. Trees have one size (Tree.pad_to).
    Returns [(accepted path, the target's next token)] per row; None for an inactive row (a finished one,
    which keeps its place in the batch so the shapes stay fixed, and changes nothing)."""
    model = target.model
    device = model.tok_embeddings.weight.device
    n = len(trees[0].tokens)
    tokens = torch.tensor([tree.tokens for tree in trees], device=device)  # [B, n]
    start = torch.tensor(pos, device=device).view(-1, 1)  # [B, 1]
    input_pos = start + torch.tensor([tree.depths for tree in trees], device=device)  # [B, n]
    slots = start + torch.arange(n, device=device)  # [B, n]
    # built on the host row by row, copied to the device once: [B, 1, n, max_seq_length]
    mask = torch.cat([tree_mask(tree.parents, p, model.max_seq_length, "cpu") for tree, p in zip(trees, pos)])
    mask = mask.to(device)
    with sdpa_context():
        logits = target.forward(tokens, input_pos, slots, mask)  # [B, n, V]
    active = active if active is not None else [True] * len(trees)
    if sampling.temperature == 0:
        argmax = logits.argmax(-1).tolist()  # one look at the host for the whole batch
        results = [verify_greedy(tree, row) if live else None for tree, row, live in zip(trees, argmax, active)]
    else:
        probs = logits_to_probs(logits, sampling)  # [B, n, V]
        results = [verify(tree, row) if live else None for tree, row, live in zip(trees, probs, active)]
    rows, src, dst = [], [], []
    for b, result in enumerate(results):
        if result is not None:
            path = result[0]
            rows += [b] * len(path)
            src += [pos[b] + node for node in path]
            dst += range(pos[b] + 1, pos[b] + 1 + len(path))
    move_cache_slots(model, src, dst, rows)
    return results


class TreeSpeculator:
    """The generation loop shared by every drafter: draft a tree per row, verify them all in one target forward,
    compact the caches, repeat. Rows (different prompts) keep their own cache length, acceptance and stop."""
    kind = "tree"

    def __init__(self, depth: int, tree_nodes: int, auto_depth: bool = False):
        self.depth, self.tree_nodes, self.auto_depth = depth, tree_nodes, auto_depth
        self.auto_choice = {}  # --speculate_k auto: batch size -> "plain" or "speculate", as measured
        self.lookahead = tree_nodes + 2  # cache slots a step may write past the accepted tokens

    def compile(self, device: str, compile_prefill: bool = False, whole_graph: Optional[bool] = None,
                autotune: bool = False):
        pass

    def generate(self, target: Engine, prompts: list, first: Tensor, max_new_tokens: int, sampling: Sampling,
                 eos_ids: list, stop_at_eos: bool, callback=None):
        """Tokens after each row's prompt (lists of ids, any lengths; the target's cache holds them, right-padded)
        and `first` ([B], the prefill's tokens). Returns ([new ids per row], acceptance stats)."""
        batch = len(prompts)
        assert callback is None or batch == 1, "streaming is for one row"
        stats = Stats(self.depth, self.tree_nodes)
        eos = set(eos_ids)
        pos = [len(p) for p in prompts]  # each row's slot of its current token (last accepted, not yet cached)
        outs = [[t] for t in first.tolist()]
        if callback:
            callback(first)

        def finished(out):
            return len(out) >= max_new_tokens or (stop_at_eos and out[-1] in eos)

        live = [not finished(out) for out in outs]
        contexts = [p + out for p, out in zip(prompts, outs)]  # a finished row's stays as it was: it idles
        # --speculate_k auto: the first generation at a batch size times a plain decode step, then its first
        # speculative steps, and decodes plainly from there on if speculation produced fewer tokens per second
        # (large batches: the verify forward is compute bound); later generations at that batch size go straight
        # to the choice made. Which lossless procedure makes the next tokens depends only on the past: lossless.
        choice = self.auto_choice.get(batch) if self.auto_depth else "speculate"
        plain_seconds = None
        if choice is None:
            plain_seconds = self.plain_step_seconds(target, contexts, pos, sampling)
        elif choice == "plain" and any(live):
            stats.plain_after = stats.target_forwards
            left = max(max_new_tokens - len(out) for out, alive in zip(outs, live) if alive)
            stats.target_forwards += self.decode_plainly(target, contexts, pos, outs, live, finished, left,
                                                         sampling, eos_ids, stop_at_eos, callback)
        if any(live):
            stats.draft_forwards += self.start(prompts, target.model.max_seq_length)
        depth = self.depth if not self.auto_depth else min(2, self.depth)
        timed = {"steps": 0, "seconds": 0.0, "tokens": 0, "plain_tokens": 0}
        while any(live):
            if plain_seconds is not None and timed["steps"] == AUTO_PROBE_STEPS + 1:
                plain_wins = timed["tokens"] / timed["seconds"] < timed["plain_tokens"] / plain_seconds
                self.auto_choice[batch] = "plain" if plain_wins else "speculate"
                plain_seconds = None  # timed enough
                if plain_wins:
                    stats.plain_after = stats.target_forwards
                    left = max(max_new_tokens - len(out) for out, alive in zip(outs, live) if alive)
                    stats.target_forwards += self.decode_plainly(target, contexts, pos, outs, live, finished, left,
                                                                 sampling, eos_ids, stop_at_eos, callback)
                    break
            started, produced, rows = time.perf_counter(), sum(map(len, outs)), sum(live)
            trees, forwards = self.draft([c[-1] for c in contexts], pos, depth, contexts, sampling)
            results = verify_step(target, [tree.pad_to(self.tree_nodes + 1) for tree in trees], pos, sampling, live)
            paths = [result[0] if result else None for result in results]
            self.accepted(paths, trees, pos)
            stats.draft_forwards += forwards
            stats.target_forwards += 1
            for b, result in enumerate(results):
                if result is None:
                    continue
                path, next_token = result
                stats.accept_counts[len(path)] += 1
                stats.drafted += depth
                new = [trees[b].tokens[node] for node in path] + [next_token]
                for t in new:
                    outs[b].append(t)
                    if callback:
                        callback(torch.tensor([t]))
                    if finished(outs[b]):
                        live[b] = False
                        break
                if live[b]:
                    pos[b] += len(new)
                    contexts[b] += new
            if plain_seconds is not None:
                synchronize(target.model)
                timed["steps"] += 1
                if timed["steps"] > 1:  # the first step may have compiled graphs
                    timed["seconds"] += time.perf_counter() - started
                    timed["tokens"] += sum(map(len, outs)) - produced
                    timed["plain_tokens"] += rows
            if self.auto_depth:  # grow after fully accepted chains, shrink after rejections
                accepted = [len(p) for p, r in zip(paths, results) if r is not None]
                mean = sum(accepted) / max(len(accepted), 1)
                depth = min(self.depth, depth + 2) if mean == depth else max(1, depth - 1) if mean < depth - 0.5 \
                    else depth
        self.finish(outs)
        return outs, stats.summary()

    @staticmethod
    def plain_step_seconds(target: Engine, contexts: list, pos: list, sampling: Sampling) -> float:
        """Seconds of one plain decode step of the whole batch: the target's decode graph on each row's current
        token, which writes only the cache slot that token's verification writes again with the same values.
        Timed on the second call (the first may compile the graph)."""
        model = target.model
        device = model.tok_embeddings.weight.device
        x = torch.tensor([c[-1] for c in contexts], device=device).view(-1, 1)  # [B, 1]
        input_pos = torch.tensor(pos, device=device).view(-1, 1)  # [B, 1]
        for _ in range(2):
            synchronize(model)
            started = time.perf_counter()
            with sdpa_context():
                target.decode_one_token(model, x, input_pos, sampling)
            synchronize(model)
        return time.perf_counter() - started

    @staticmethod
    def decode_plainly(target: Engine, contexts: list, pos: list, outs: list, live: list, finished, n: int,
                       sampling: Sampling, eos_ids: list, stop_at_eos: bool, callback=None) -> int:
        """Finish the live rows one token per target forward (decode.decode_n_tokens: at most n tokens after
        each row's current one); returns the forwards it took."""
        device = target.model.tok_embeddings.weight.device
        roots = torch.tensor([c[-1] for c in contexts], device=device)  # [B]
        rest = decode_n_tokens(target, roots, torch.tensor(pos, device=device), n, sampling, eos_ids, stop_at_eos,
                               callback)
        for b, column in enumerate(torch.stack(rest, 1).tolist()):  # [B, forwards]
            for t in column:
                if not live[b]:
                    break
                outs[b].append(t)
                live[b] = not finished(outs[b])
        return len(rest)

    # what a drafter provides
    def start(self, prompts: list, max_seq_length: int) -> int:
        """A new generation after each row's prompt; returns the draft forwards it ran."""
        return 0

    def draft(self, roots: list, pos: list, depth: int, contexts: list, sampling: Sampling):
        """One tree per row, rooted at roots[b] (cache slot pos[b]; contexts[b] ends with it), and the draft
        forwards they took."""
        raise NotImplementedError

    def accepted(self, paths: list, trees: list, pos: list):
        """The verifier accepted paths[b] (node indices of trees[b]) in each row; None in a finished row."""

    def finish(self, outs: list):
        """The generation ended with these new tokens (one list per row)."""


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
        """(accepted, reached) per cell as float64 tensors, and the prior's weight w as a 0-d tensor."""
        return (torch.tensor(self.accepted, dtype=torch.double), torch.tensor(self.reached, dtype=torch.double),
                torch.tensor(self.PRIOR_WEIGHT * self.unit, dtype=torch.double))

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


def draft_tree(model, x: Tensor, input_pos: Tensor, sampling: Sampling, depth: int, width: int, accepted: Tensor,
               reached: Tensor, weight: Tensor):
    """The dynamic tree of every row in one graph (DraftModelSpeculator.compile): the tree that
    DraftModelSpeculator.draft grows depth by depth on the host (without lookups), K forwards and no host sync.
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
    batch, device = x.shape[0], x.device
    span = max(depth - 1, 1) * width  # the draft-cache slots after the root that frontier nodes are read at
    size = 1 + width + (depth - 1) * width * width
    pos = input_pos[:, -1:]  # [B, 1] the root's slot
    tokens, scores, cells, q = tree_children(model(x, input_pos)[:, -1], sampling, width, accepted, reached, weight)
    qs = [q]  # [B, V], then [B, width, V] per depth: the distributions the children were drawn from (sampled)
    rows = [torch.full_like(pos, -1), torch.zeros_like(tokens)]  # each candidate's row of qs (its parent's)
    root = torch.full_like(pos, -1)
    all_tokens, all_parents, all_cells = [x[:, -1:], tokens], [root, torch.zeros_like(tokens)], [root, cells]
    all_scores = torch.cat([torch.zeros_like(scores[:, :1]), scores], 1)  # [B, 1 + width]
    slots = torch.cat([pos, torch.full((batch, size - 1), -1, dtype=pos.dtype, device=device)], 1)  # [B, M]
    newest = torch.arange(1, 1 + width, device=device).expand(batch, width)  # [B, n]: the latest depth's nodes
    seen = torch.zeros(batch, width, span, dtype=torch.bool, device=device)  # tree slots each frontier node sees
    cache_slots = torch.arange(model.max_seq_length, device=device)  # [S]
    offset = (cache_slots - (pos + 1)).clamp(0, span - 1).unsqueeze(1).expand(batch, width, -1)  # [B, width, S]
    after_root = ((cache_slots > pos) & (cache_slots <= pos + span)).unsqueeze(1)  # [B, 1, S]
    for d in range(1, depth):
        order = torch.sort(all_scores.gather(1, newest), dim=-1, descending=True, stable=True).indices[:, :width]
        frontier = newest.gather(1, order)  # [B, width]
        first = (d - 1) * width  # the frontier's first slot after the root, minus one
        read_at = pos + 1 + first + torch.arange(width, device=device)  # [B, width]
        slots = slots.scatter(1, frontier, read_at)
        parent = order // width if d > 1 else torch.zeros_like(order)  # each one's parent's place in the last frontier
        own = torch.arange(span, device=device) == first + torch.arange(width, device=device).view(-1, 1)  # [width, S']
        seen = seen.gather(1, parent.unsqueeze(-1).expand(-1, -1, span)) | own  # [B, width, span]
        mask = (cache_slots <= pos).unsqueeze(1) | (seen.gather(2, offset) & after_root)  # [B, width, S]
        fed = torch.cat(all_tokens, 1).gather(1, frontier)  # [B, width]
        logits = model(fed, (pos + d).expand(batch, width), read_at, mask.unsqueeze(1))  # [B, width, V]
        tokens, scores, cells, q = tree_children(logits.flatten(0, 1), sampling, width, accepted, reached,
                                                 weight)  # [B * width, width] each, q [B * width, V]
        qs.append(q.view(batch, width, -1) if q is not None else None)  # [B, width, V]
        rows.append((1 + first + torch.arange(width, device=device)).repeat_interleave(width).expand(batch, -1))
        all_tokens.append(tokens.view(batch, width * width))
        all_parents.append(frontier.repeat_interleave(width, 1))  # [B, width * width]
        all_cells.append(cells.view(batch, width * width))
        below = all_scores.gather(1, frontier).unsqueeze(-1) + scores.view(batch, width, width)  # [B, width, width]
        newest = all_scores.shape[1] + torch.arange(width * width, device=device).expand(batch, -1)
        all_scores = torch.cat([all_scores, below.view(batch, width * width)], 1)
    ranked = torch.sort(all_scores[:, 1:], dim=-1, descending=True, stable=True).indices + 1  # [B, M - 1]
    nodes = torch.stack([torch.cat(all_tokens, 1), torch.cat(all_parents, 1), torch.cat(all_cells, 1), slots,
                         (all_scores > -math.inf).long(), torch.cat(rows, 1)], 1)  # [B, 6, M]
    sampled = sampling.temperature > 0
    return ranked, nodes, torch.cat([qs[0].unsqueeze(1)] + qs[1:], 1) if sampled else None  # [B, R, V]


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
        self.width = 1 if tree_nodes == depth else min(8, max(2, math.ceil(tree_nodes / depth)))
        self.lookahead = max(tree_nodes, (depth - 1) * self.width) + 2
        self.engine = Engine(draft_model)
        self.candidates, self.logits = draft_candidates, draft_logits
        self.draft_forward = draft_model  # what candidates() / logits() run: the model, or its regional forward
        self.write_cache = draft_model
        # a fixed-depth chain's K draft steps in one call (draft_chain), compiled as one graph where the draft compiles
        # whole; None: step by step through read() (trees, --speculate_k auto, a regionally compiled draft)
        self.chain = draft_chain if self.width == 1 and not auto_depth else None
        # likewise a greedy tree without lookups (draft_tree); None: depth by depth on the host (sampled trees, merged
        # lookups, a regionally compiled draft)
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
        whole_graph, mode = whole_graph_mode(device, whole_graph, autotune, n_layer=self.draft_model.args.n_layer)
        if whole_graph:
            if self.chain is not None:  # one graph, one host sync, one CUDA graph for K tokens
                self.chain = torch.compile(draft_chain, mode=mode, fullgraph=True, dynamic=False)
            if self.tree is not None:
                self.tree = torch.compile(draft_tree, mode=mode, fullgraph=True, dynamic=False)
            self.candidates = torch.compile(draft_candidates, mode=mode, fullgraph=True, dynamic=False)
            self.logits = torch.compile(draft_logits, mode=mode, fullgraph=True, dynamic=False)
            if compile_prefill:
                self.write_cache = torch.compile(self.draft_model, fullgraph=True, dynamic=True)
        else:  # regional: the engine's forward runs the compiled block for every layer
            self.draft_forward = self.engine.forward
            self.chain = self.tree = None  # a chain steps through the engine's compiled one-token decode
            if compile_prefill:
                self.write_cache = functools.partial(self.draft_model, block=compiled_region(run_block, True))

    def start(self, prompts: list, max_seq_length: int) -> int:
        device = self.draft_model.tok_embeddings.weight.device
        self.draft_model.setup_caches(len(prompts), max_seq_length)
        T = max(len(p) for p in prompts)
        x = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=device)  # [B, T], right-padded
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        with sdpa_context():
            self.engine.prefill(self.draft_model, x, torch.arange(T, device=device).expand(len(prompts), T),
                                Sampling(), lengths - 1)
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
            with sdpa_context():
                self.write_cache(x, torch.tensor(at, device=device))
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
        """Every row's tree through the one-graph draft_tree (fed, like draft_chain, each row's token before the root
        and the root), cut to the tree_nodes best as select() cuts it."""
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
                tokens, log_q, log_prior = self.candidates(self.draft_forward, x, input_pos, slots, mask, self.width, last)
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


class Lookup:
    """Draft-free drafting (Lookahead, Zhao et al. 2023): continuations of the current suffix found
    earlier in the context (prompt and output) and in the earlier samples of the run, merged into a trie.
    Every 1..n-1-gram's occurrences are indexed as the text grows, so a lookup scans nothing."""

    def __init__(self, n: int, in_samples: Optional[dict] = None):
        self.n = n
        # gram (tuple) -> [(an earlier sample's ids, index just after the gram)]
        self.in_samples = {} if in_samples is None else in_samples
        self.context, self.in_context = [], {}

    def fresh(self) -> "Lookup":
        """A lookup for a new generation (one row): its own context, this run's earlier samples."""
        return Lookup(self.n, self.in_samples)

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

    def start(self, prompts: list, max_seq_length: int) -> int:
        self.lookups = [self.lookup.fresh() for _ in prompts]
        return 0

    def draft(self, roots: list, pos: list, depth: int, contexts: list, sampling: Sampling):
        trees = [self.best_first(root, lookup.trie(context, depth))
                 for root, lookup, context in zip(roots, self.lookups, contexts)]
        return trees, 0

    def best_first(self, root: int, trie: dict) -> Tree:
        tree = Tree.rooted_at(root)
        frontier = [(-count, 1, token, sub, 0) for token, (count, sub) in trie.items()]
        while frontier and len(tree.tokens) <= self.tree_nodes:
            frontier.sort(key=lambda f: (f[0], f[1]))
            _, depth, token, sub, parent = frontier.pop(0)
            node = tree.add(token, parent)
            frontier += [(-c, depth + 1, t, s, node) for t, (c, s) in sub.items()]
        return tree

    def finish(self, outs: list):
        for out in outs:
            self.lookup.finish(out)


def same_vocabulary(target_tokenizer, draft_tokenizer, target_vocab_size: int, draft_vocab_size: int) -> bool:
    """Whether a draft can propose target token ids as they are: the same ids for the same text."""
    if target_vocab_size != draft_vocab_size:
        return False
    probe = "def main():\n    return 42  # The quick brown fox, naïve café 日本"
    return draft_tokenizer.encode(probe) == target_tokenizer.encode(probe)


MAX_TREE_NODES = 256  # a verify forward over more nodes costs more than it can accept, on any hardware


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


def format_stats(stats: dict) -> str:
    return (f"Acceptance: mean accepted {stats['mean_accepted']:.2f} of K={stats['speculate_k']} "
            f"(rate {stats['acceptance_rate']:.1%}, {stats['tokens_per_target_forward']:.2f} tokens per target "
            f"forward), accept_counts {stats['accept_counts']}, target forwards {stats['target_forwards']}, "
            f"draft forwards {stats['draft_forwards']}")
