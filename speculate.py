"""Speculative decoding: draft sources, token-tree verification, KV-cache compaction, acceptance stats.

Every step drafts a token tree rooted at the current token, scores all of its nodes in ONE target
forward (tree attention: positions = prefix length + depth, each node sees the prefix and its own
ancestors), accepts a root-to-node path plus one token from the target, and moves the accepted
path's keys/values to contiguous cache slots (Speculator: draft -> verify -> accept). A chain (tree_nodes ==
speculate_k) is the tree with one child per node; every Drafter (the n-gram lookup here, the draft model in
draftmodel.py) feeds the same verifier. A draft with another tokenizer has a loop of its own (crossdraft.py).
"""
import collections
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

import torch
from torch import Tensor

from decode import EOS_CHECK_EVERY, Engine, Sampling, chosen_is_finite, decode_n_tokens, logits_to_probs, \
    sample, sample_from, sdpa_context
from errors import UserError, write_atomically
from grammar import apply_bitmask

NO_PARENT = -2  # padding node: not part of the tree, never accepted


def non_finite_logits(model, when: str) -> UserError:
    """The one line for NaN / infinite target logits (prefill, plain decoding, verification)."""
    source = getattr(model, "checkpoint_path", "the checkpoint")
    return UserError(f"the model's logits {when} are NaN or infinite: the weights in {source} are broken (or overflow "
                     f"in this precision); re-convert or re-download it (or try `precision` fp32)")


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
    (draftmodel.ModelDrafter.select). A deterministic child has a point-mass proposal: accepted with
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


@dataclass
class Stats:
    """Acceptance figures of one generation."""
    depth: int
    tree_nodes: int
    accept_counts: list = None  # accept_counts[i]: verify steps that accepted i drafted tokens
    target_forwards: int = 1  # the prefill
    draft_forwards: int = 0
    drafted: int = 0  # depth drafted, summed over the steps
    plain_steps: int = 0  # `auto` chose plain steps (one token per row, no draft) this many times

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
            "plain_steps": self.plain_steps,
        }


def combine_stats(summaries: list) -> dict:
    """One Stats.summary() for several generations (the batches of a prompts file)."""
    total = Stats(summaries[0]["speculate_k"], summaries[0]["tree_nodes"], target_forwards=0)
    for summary in summaries:
        total.accept_counts = [a + b for a, b in zip(total.accept_counts, summary["accept_counts"])]
        total.target_forwards += summary["target_forwards"]
        total.draft_forwards += summary["draft_forwards"]
        total.drafted += summary["drafted"]
        total.plain_steps += summary.get("plain_steps", 0)
    return total.summary()


def tree_inputs(trees: list, pos: list, max_seq_length: int, device):
    """One verification forward's inputs for every row's tree (one size, Tree.pad_to): row b's node i at cache slot
    pos[b] + i and RoPE position pos[b] + depth, seeing the row's prefix and its ancestors. Returns tokens,
    input_pos, slots [B, n] and the mask [B, 1, n, max_seq_length], built on the host and moved to `device` once."""
    n = len(trees[0].tokens)
    tokens = torch.tensor([tree.tokens for tree in trees])  # [B, n]
    start = torch.tensor(pos).view(-1, 1)  # [B, 1]
    input_pos = start + torch.tensor([tree.depths for tree in trees])  # [B, n]
    slots = start + torch.arange(n)  # [B, n]
    mask = torch.cat([tree_mask(tree.parents, p, max_seq_length, "cpu") for tree, p in zip(trees, pos)])
    return tokens.to(device), input_pos.to(device), slots.to(device), mask.to(device)


def keep_paths(move, paths: list, pos: list):
    """Each row's accepted path (node indices; node i was at slot pos[b] + i; None: nothing kept) moved to the
    slots right after its root, in every layer's cache, by `move` (an engine's move_cache_slots: under tensor
    parallelism the other ranks move theirs too)."""
    rows, src, dst = [], [], []
    for b, path in enumerate(paths):
        if path is not None:
            rows += [b] * len(path)
            src += [pos[b] + node for node in path]
            dst += range(pos[b] + 1, pos[b] + 1 + len(path))
    move(src, dst, rows)


def target_logprobs(logits: Tensor) -> Tensor:
    """log_softmax of the target's logits at temperature 1, before temperature, top-k or top-p: what a client scoring
    text (log-likelihoods, perplexity) asks of the model, whatever its sampling settings."""
    return logits.float().log_softmax(-1)


def verify_step(target: Engine, trees: list, pos: list, sampling: Sampling, active: Optional[list] = None,
                features: bool = False, logprobs: bool = False, masks: Optional[list] = None):
    """One target forward over every row's tree (tree_inputs), then verification of each active row, then
    each accepted path's keys/values moved to the slots right after its root. Trees have one size (Tree.pad_to).
    Returns [(accepted path, the target's next token)] per row; None for an inactive row (a finished one,
    which keeps its place in the batch so the shapes stay fixed, and changes nothing). With `features`, also the
    target's features of every node [B, n, F] (Engine.forward_features: what a draft head reads). With `logprobs`,
    each row's result also holds the target's log-probabilities at the tokens it emits ([len(path) + 1, V],
    target_logprobs: of the raw logits, before any mask). masks: per row, None or a grammar's bitmask of its first
    nodes ([m, words], constrain()): their logits masked before verifying."""
    model = target.model
    device = model.tok_embeddings.weight.device
    tokens, input_pos, slots, mask = tree_inputs(trees, pos, model.max_seq_length, device)
    with sdpa_context():
        if features:
            logits, hidden = target.forward_features(tokens, input_pos, slots, mask)  # [B, n, V], [B, n, F]
        else:
            logits = target.forward(tokens, input_pos, slots, mask)  # [B, n, V]
    if not bool((logits < float("inf")).all()):  # NaN or +inf (-inf only rules its token out); the step syncs anyway
        raise non_finite_logits(model, "for a verified draft")
    active = active if active is not None else [True] * len(trees)
    raw = logits
    for b, bitmask in enumerate(masks or []):
        if bitmask is not None:
            if logits is raw:  # a copy: logprobs are the raw logits', and a forward's output may be reused
                logits = logits.to(torch.float32, copy=True)
            apply_bitmask(logits[b, :len(bitmask)], bitmask)
    if sampling.temperature == 0:
        argmax = logits.argmax(-1).tolist()  # one look at the host for the whole batch
        results = [verify_greedy(tree, row) if live else None for tree, row, live in zip(trees, argmax, active)]
    else:
        probs = logits_to_probs(logits, sampling)  # [B, n, V]
        results = [verify(tree, row) if live else None for tree, row, live in zip(trees, probs, active)]
    if logprobs:  # the emitted tokens are scored at the root and at each accepted node (each one's next token)
        results = [result and result + (target_logprobs(raw[b, [0] + result[0]]),)
                   for b, result in enumerate(results)]
    keep_paths(target.move_cache_slots, [result[0] if result is not None else None for result in results], pos)
    return (results, hidden.clone()) if features else results  # clone: a CUDA graph's replay overwrites its outputs


class RowConstraint(Protocol):
    """What the loop asks of a row's grammar (grammar.Constraint): it has taken the row's tokens so far."""
    ended: bool  # the grammar is done, or allows no token (the row ends)

    def prune(self, tree: Tree) -> tuple:
        """(the tree without the drafts it forbids, proposals renormalised; [kept nodes, words] int32 bitmask of the
        tokens allowed after each kept node's path)."""

    def accept(self, token: int) -> bool:
        """Take the row's next token; False at a dead end (no token was allowed: the row ends without it)."""


def constrain(trees: list, constraints: Optional[list], live: list) -> tuple:
    """Each live row's tree without the drafted nodes its grammar forbids, and the bitmask that masks the target's
    logits at each kept node (grammar.Constraint.prune: verification stays exact); a row without a constraint (None)
    or not live as it is. Returns (trees, masks or None)."""
    if constraints is None:
        return trees, None
    pruned = [c.prune(tree) if c is not None and on else (tree, None) for tree, c, on in zip(trees, constraints, live)]
    return [tree for tree, _ in pruned], [bitmask for _, bitmask in pruned]


# ----------------------------------------------------------------------------- the speculative loop

class Drafter(Protocol):
    """What the speculative loop asks of a draft source (draftmodel.ModelDrafter, NgramDrafter): every step, one
    token tree per row, rooted at the row's current token."""
    kind: str  # for the stats: "draft" (a chain), "tree", "ngram" or "head"
    depth: int  # draft tokens per path
    tree_nodes: int  # drafted nodes per tree (== depth: a chain)
    lookahead: int  # cache slots a step may write past the accepted tokens
    features: tuple  # target blocks whose inputs it reads (a draft head); () for none
    # optional, caught_up: when its last draft() had read the tokens accepted before it (perf_counter), for a drafter
    # that reads them late (draftmodel.ModelDrafter): `auto` does not price that reading in the arm drafted next

    def start(self, prompts: list, max_seq_length: int, features: Optional[Tensor] = None) -> int:
        """A new generation after each row's prompt (features: the prompts' target features [B, T, F], if it reads
        them); returns the draft forwards it ran."""

    def draft(self, roots: list, pos: list, depth: int, contexts: list, sampling: Sampling, nodes=None) -> tuple:
        """One tree per row, rooted at roots[b] (cache slot pos[b]; contexts[b] ends with it), of up to `nodes`
        drafted nodes (default tree_nodes), and the draft forwards they took."""

    def accepted(self, paths: list, trees: list, pos: list, features: Optional[Tensor] = None):
        """The verifier accepted paths[b] (node indices of trees[b]) in each row; None in a finished row. features:
        the target's features of every tree node [B, n, F], if it reads them."""

    def finish(self, outs: list):
        """The generation ended with these new tokens (one list per row)."""


class AutoChoice:
    """`speculate_k auto` / `tree_nodes auto`: before every step, the depth K and tree size N (an "arm"), or plain
    decoding, with the most expected tokens per second, E(K, N) / (draft seconds(K, N) + verify seconds(N + 1)),
    from what this run measured (a hardware-aware choice, as Sequoia's tree optimizer, Chen et al. 2024):
    - verify seconds per batch size and width: every step is timed whole (its verification or plain steps and
      their bookkeeping); an unmeasured width is interpolated linearly from measured ones, and no width costs
      clearly more than a wider one measured (plain decoding is width 1, timed once before the first step);
    - draft seconds per arm: timed when it runs; an unmeasured arm costs its depth times the measured seconds per
      depth of arms of its kind (chain or tree), zero if none ran yet (so it gets tried);
    - both tables kept between runs where the target runs stored graphs (StoredCosts, beside them): a later run of
      the same configuration starts from the last one's timings, and goes on timing;
    - a first timing counts as no timing until a second replaces it: a first call can pay one-time costs (a stored
      graph loaded, a new width's first run), and an arm priced by one would never run again to correct it;
    - E(K, chain) = 1 + sum_i prod_{d <= i} a_d from each depth's acceptance rate a_d (decaying counts over the
      drafted chains: a chain of depth K also tells what any shorter one would have accepted); E(K, tree) from the
      tokens its own steps made, starting from an optimistic prior.
    Plain decoding wins where no arm beats it; then one step of the cheapest arm (the shortest chain, whose
    verification costs about a plain step) after EXPLORE_EVERY plain steps keeps the first depth's acceptance
    current, the interval doubling (up to MAX_EXPLORE_EVERY) while plain decoding keeps winning, so a drafter that
    never pays costs a vanishing share of the steps; once drafts pay again, the best arm takes over. The choice
    depends only on the past, so every step stays lossless."""
    EXPLORE_EVERY, MAX_EXPLORE_EVERY = 8, 256
    PRIOR = 0.6  # the prior acceptance rate of a drafted node, worth PRIOR_WEIGHT observations
    PRIOR_WEIGHT = 2.0
    DECAY = 0.98  # per observation: acceptance drifts with the text
    EMA = 0.2  # weight of a new timing
    WIDER_SLACK = 1.1  # a width is priced at most this much above a wider one measured

    def __init__(self, arms: list):
        self.arms = arms  # [(K, N)]
        depth = max(k for k, _ in arms)
        self.accepted = [self.PRIOR * self.PRIOR_WEIGHT] * (depth + 1)  # per depth d (index d): decayed counts
        self.reached = [self.PRIOR_WEIGHT] * (depth + 1)
        self.tree_tokens = {}  # arm -> [decayed tokens per row-step, decayed steps]
        self.verify_seconds = {}  # (batch, width) -> seconds
        self.draft_seconds = {}  # arm -> seconds (the whole batch's draft)
        self.first = set()  # (table id, key) timed once only: not used yet
        self.plain_streak, self.explore_every = 0, self.EXPLORE_EVERY
        self.decision = None  # (batch, best arm, plain wins), kept while only plain steps are observed
        self.store = None  # a StoredCosts: where the timings are kept for the next run

    def costs(self) -> dict:
        """The timings in use (StoredCosts keeps them): verify [[batch, width, s]], draft [[K, N, s]]."""
        return {"verify": [[b, w, t] for (b, w), t in sorted(self.measured(self.verify_seconds).items())],
                "draft": [[k, n, t] for (k, n), t in sorted(self.measured(self.draft_seconds).items())]}

    def seed(self, costs: dict):
        """Timings an earlier run stored, used at once; this run's own timings update them (EMA)."""
        self.verify_seconds.update({(b, w): t for b, w, t in costs["verify"]})
        self.draft_seconds.update({(k, n): t for k, n, t in costs["draft"] if (k, n) in self.arms})
        self.decision = None

    def finished(self):
        """A generation ended: keep the timings for the next run (StoredCosts)."""
        if self.store is not None:
            self.store.save(self.costs())

    def expected(self, arm) -> float:
        """Expected tokens per row and step."""
        k, n = arm
        total, reach = 1.0, 1.0
        for d in range(1, k + 1):
            reach *= self.accepted[d] / self.reached[d]
            total += reach
        if n == k:
            return total
        made, steps = self.tree_tokens.get(arm, (0.0, 0.0))
        prior = total * 1.2  # a tree of more nodes than its depth: worth trying
        return (made + prior * self.PRIOR_WEIGHT) / (steps + self.PRIOR_WEIGHT)

    def measured(self, table: dict) -> dict:
        return {key: t for key, t in table.items() if (id(table), key) not in self.first}

    def verify_cost(self, batch: int, width: int) -> float:
        """Seconds of a step verifying `width` tokens per row: measured, interpolated, and never clearly more than a
        wider step measured (a timing taken in a slow moment, of a width no longer chosen, is never taken again to
        correct it: a plain step priced above a width-2 verification would keep `auto` from ever stepping plainly;
        within WIDER_SLACK the widths of a bandwidth-bound forward cost the same, and their timings stand)."""
        known = sorted((w, t) for (b, w), t in self.measured(self.verify_seconds).items() if b == batch)
        if not known:
            return 0.0
        cap = self.WIDER_SLACK * min((t for w, t in known if w > width), default=float("inf"))
        exact = dict(known).get(width)
        if exact is not None:
            return min(exact, cap)
        if len(known) == 1:  # one width measured: assume flat (bandwidth-bound) until another is
            return known[0][1]
        below = [kt for kt in known if kt[0] < width] or known[:1]
        above = [kt for kt in known if kt[0] > width] or known[-1:]
        (w0, t0), (w1, t1) = below[-1], above[0]
        if w0 == w1:
            (w0, t0), (w1, t1) = known[-2], known[-1]
        return min(max(t0 + (t1 - t0) * (width - w0) / (w1 - w0), 0.0), cap)

    def draft_cost(self, arm) -> float:
        measured = self.measured(self.draft_seconds)
        if arm in measured:
            return measured[arm]
        k, n = arm
        same = [t / a[0] for a, t in measured.items() if (a[1] == a[0]) == (n == k)]
        return k * sum(same) / len(same) if same else 0.0

    def choose(self, batch: int):
        """The arm for the next step, or None for a plain step."""
        if self.decision is None or self.decision[0] != batch:
            plain = self.verify_cost(batch, 1)
            rate = {arm: self.expected(arm) / max(self.draft_cost(arm) + self.verify_cost(batch, arm[1] + 1), 1e-9)
                    for arm in self.arms}
            best = max(self.arms, key=lambda arm: (rate[arm], -arm[1], -arm[0]))
            self.decision = (batch, best, plain > 0 and 1.0 / plain >= rate[best])
        _, best, plain_wins = self.decision
        if plain_wins and self.plain_streak < self.explore_every:
            self.plain_streak += 1
            return None
        self.plain_streak = 0
        if plain_wins:  # exploring, with the cheapest arm (it costs about a plain step); wait longer next time
            self.explore_every = min(2 * self.explore_every, self.MAX_EXPLORE_EVERY)
            return min(self.arms, key=lambda arm: (arm[1], arm[0]))
        self.explore_every = self.EXPLORE_EVERY
        return best

    def plain_run(self, limit: int) -> int:
        """After choose() returned None: the plain steps in a row (at least 1, at most `limit`) the choice takes
        before its next exploration, counted as taken. A loop that runs them together pays plain decoding's cost
        per token, without its own work between tokens (crossdraft)."""
        n = max(1, min(limit, self.explore_every - self.plain_streak + 1))
        self.plain_streak += n - 1
        return n

    def timed(self, table: dict, key, seconds: float, warm: bool = False):
        """A new timing of `key` (warm: taken after a first call, trusted at once)."""
        old, first = table.get(key), (id(table), key)
        if old is None or first in self.first:  # a first timing (unused unless warm), or the second replacing it
            if old is None and not warm:
                self.first.add(first)
            else:
                self.first.discard(first)
            table[key] = seconds
        else:
            table[key] = (1 - self.EMA) * old + self.EMA * seconds

    def observe(self, arm, trees: list, paths: list, draft_seconds: float, verify_seconds: float, batch: int,
                width: Optional[int] = None, steps: int = 1):
        """A step of `arm` (None: plain; `steps` plain steps run together, plain_run): its timings and, per live
        row, the tree and accepted path; width: the tokens verified, where they are not the arm's N + 1 (a draft of
        another tokenizer)."""
        width = width or (1 if arm is None else arm[1] + 1)
        self.timed(self.verify_seconds, (batch, width), verify_seconds / steps)
        if arm is None:  # the decision stands (the plain step's seconds drift slowly) but every 16 plain steps
            if self.plain_streak % 16 == 0 or steps > 1:
                self.decision = None
            return
        self.decision = None
        self.timed(self.draft_seconds, arm, draft_seconds)
        k, n = arm
        live = [(tree, path) for tree, path in zip(trees, paths) if path is not None]
        if n == k:  # a chain: depth d was reached if the d - 1 nodes above it were accepted
            for _, path in live:
                for d in range(1, k + 1):
                    if len(path) < d - 1:
                        break
                    self.accepted[d] = self.accepted[d] * self.DECAY + (len(path) >= d)
                    self.reached[d] = self.reached[d] * self.DECAY + 1.0
        else:
            made, steps = self.tree_tokens.get(arm, (0.0, 0.0))
            for _, path in live:
                made, steps = made * self.DECAY + len(path) + 1, steps * self.DECAY + 1
            self.tree_tokens[arm] = (made, steps)


class StoredCosts:
    """AutoChoice's timings for one configuration (the target's stored graph, the drafter, the speculation settings,
    this machine and thread count: `key`), in a small JSON file beside the target's stored graphs, so that a run
    chooses from its first step as the last run ended instead of exploring again (Sequoia's tree optimizer, Chen et
    al. 2024, also measures the hardware once). Timings only steer the choice, which is lossless whatever they say: a
    damaged or foreign file is ignored with one line and replaced."""
    SAVE_EVERY = 30.0  # seconds between writes while the same keys are timed (a server finishes many generations)

    def __init__(self, path, key: str):
        self.path, self.key = Path(path), key
        self.saved, self.saved_at = None, 0.0  # the keys last written and when
        self.writable = True

    def load(self) -> Optional[dict]:
        """The stored timings ({"verify": [(batch, width, s)], "draft": [(K, N, s)]}), or None."""
        if not self.path.exists():
            return None
        why, costs = "it is unreadable", None
        try:
            data = json.loads(self.path.read_text())
            if isinstance(data, dict) and data.get("key") != self.key:
                why = "it was stored for another configuration"
            else:
                costs = {name: [(int(a), int(b), float(t)) for a, b, t in data[name]] for name in ("verify", "draft")}
                if not all(a >= 1 and b >= 1 and 0 < t < 3600 for rows in costs.values() for a, b, t in rows):
                    why, costs = "it holds timings that cannot be", None
        except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError):
            pass
        if costs is None:
            print(f"ignoring the stored timings {self.path}: {why}; timing again", file=sys.stderr)
        return costs

    def save(self, costs: dict):
        keys = [(name, *row[:2]) for name, rows in costs.items() for row in rows]
        recent = keys == self.saved and time.monotonic() - self.saved_at < self.SAVE_EVERY
        if not self.writable or not keys or recent:
            return
        text = json.dumps({"key": self.key, **costs}, indent=1)
        try:
            write_atomically(self.path, lambda tmp: tmp.write_text(text))
        except OSError as e:  # a full or read-only disk: this run keeps its timings in memory
            print(f"could not keep the timings in {self.path} ({e.strerror or e}); going on without",
                  file=sys.stderr)
            self.writable = False
            return
        self.saved, self.saved_at = keys, time.monotonic()


def auto_arms(depth: int, tree_nodes: Optional[int], auto_depth: bool, auto_nodes: bool, max_nodes: int) -> list:
    """The (K, N) pairs `auto` chooses among: every depth up to `depth` if auto_depth (else `depth`), each as a chain
    and, if auto_nodes, as trees of 2K, 4K and 8K nodes up to max_nodes; else as trees of `tree_nodes` (None: a
    chain)."""
    depths = range(1, depth + 1) if auto_depth else [depth]
    arms = []
    for k in depths:
        if auto_nodes:
            sizes = [k] + [m * k for m in (2, 4, 8) if m * k <= max_nodes]
        else:
            sizes = [max(k, tree_nodes or k)]
        arms += [(k, n) for n in sizes]
    return arms


class Speculator:
    """The generation loop shared by every drafter: draft a tree per row, verify them all in one target forward,
    accept a path per row and compact the caches, repeat. Rows (different prompts) keep their own cache length,
    acceptance and stop. With `auto` (an AutoChoice) each step's depth and tree size, or a plain step, is chosen."""

    gives_logprobs = True  # generate(logprobs=True) scores every token it makes

    def __init__(self, drafter: Drafter, auto: Optional[AutoChoice] = None):
        self.drafter = drafter
        self.auto = auto
        self.kind, self.lookahead, self.features = drafter.kind, drafter.lookahead, drafter.features

    def forget(self):
        """Forget earlier generations' text (n-gram lookups draw on the run's earlier samples): benchmarks call it
        before each timed run, so that a repeated prompt does not copy its last answer. Timings stay learned."""
        lookup = getattr(self.drafter, "lookup", None)
        if lookup is not None:
            lookup.forget()

    def generate(self, target: Engine, prompts: list, first: Tensor, max_new_tokens: int, sampling: Sampling,
                 eos_ids: list, stop_at_eos: bool, callback=None, features: Optional[Tensor] = None,
                 logprobs: bool = False, constraints: Optional[list] = None):
        """Tokens after each row's prompt (lists of ids, any lengths; the target's cache holds them, right-padded)
        and `first` ([B], the prefill's tokens); features: the prompts' target features [B, T, F] where the drafter
        reads them. With `logprobs`, callback(token, scores) also gets the target's log-probabilities [V] where each
        token was chosen (target_logprobs), whether it came from an accepted draft or a plain step; None for `first`
        (the caller's prefill scored it). constraints: per row, None or a grammar.Constraint that has taken `first`
        (drafts it forbids are cut, the target's logits masked, every step verifies: no plain runs). Returns ([new
        ids per row], acceptance stats)."""
        drafter, batch, auto = self.drafter, len(prompts), self.auto
        assert callback is None or batch == 1, "streaming is for one row"
        stats = Stats(drafter.depth, drafter.tree_nodes)
        rows = Rows(prompts, [[t] for t in first.tolist()], max_new_tokens, set(eos_ids), stop_at_eos, constraints)
        if callback:
            callback(first, None) if logprobs else callback(first)
        if any(rows.live):
            stats.draft_forwards += drafter.start(prompts, target.model.max_seq_length, features)
        if auto and any(rows.live) and (batch, 1) not in auto.verify_seconds:
            auto.timed(auto.verify_seconds, (batch, 1), plain_step_seconds(target, rows.contexts, rows.pos, sampling,
                                                                           bool(self.features)), warm=True)
        after_plain = True  # (the first draft reads the prompt: a cost of switching too)
        while any(rows.live):
            arm = auto.choose(batch) if auto else (drafter.depth, drafter.tree_nodes)
            started = time.perf_counter()
            if arm is None and all(rows.live) and constraints is None:
                step = self.plain_run(target, rows, sampling, eos_ids, callback, stats, started, first.device,
                                      logprobs)
            elif arm is None:
                step = self.one_plain_step(target, rows, sampling, stats, started, logprobs)
            else:
                step = self.speculative_step(target, rows, arm, sampling, stats, started, after_plain, logprobs)
            after_plain = arm is None
            rows.extend(step.news, None if step.streamed else callback, step.scores)
            if auto:  # the whole step, its bookkeeping included: what a step of this arm costs
                synchronize(target.model)
                auto.observe(arm, step.trees, step.paths, step.drafted - step.started,
                             time.perf_counter() - step.drafted, batch, steps=step.steps)
        drafter.finish(rows.outs)
        if auto:
            auto.finished()
        return rows.outs, stats.summary()

    def plain_run(self, target: Engine, rows: "Rows", sampling: Sampling, eos_ids: list, callback, stats: Stats,
                  started: float, device, logprobs: bool = False) -> "Step":
        """Plain steps, as many as the choice takes in a row, through plain decoding's own loop (no host work
        between tokens); the drafter hears of each as of a plain step (a draft model catches up later, a head reads
        the features each step gave)."""
        steps = self.auto.plain_run(min(rows.max_new_tokens - len(out) for out in rows.outs))
        last = torch.tensor([c[-1] for c in rows.contexts], device=device)
        scores, plain = None, not self.features and not logprobs
        if not plain:  # through the loop that keeps what the drafter or the callback needs of each step
            made, hidden, scores = run_plain_steps(target, last, rows.pos, steps, sampling, bool(self.features),
                                                   logprobs)
            hidden = hidden if self.features else None
            scores = [[s[b] for s in scores] for b in range(len(last))] if logprobs else None  # [B][steps] of [V]
        else:
            made, hidden = decode_n_tokens(target, last, rows.pos, steps, sampling, eos_ids, rows.stop_at_eos,
                                           callback), None
        steps = len(made)
        made = torch.stack(made, 1).tolist()  # [B, steps]
        kept = [rows.taken(out, row) for out, row in zip(rows.outs, made)]  # the drafter hears of a row's tokens
        for i in range(steps):
            trees = [Tree.rooted_at(c[-1] if i == 0 else row[i - 1]) for c, row in zip(rows.contexts, made)]
            self.drafter.accepted([[] if i < kept[b] else None for b in range(len(made))], trees, rows.pos,
                                  None if hidden is None else hidden[i])
        stats.plain_steps += steps
        stats.target_forwards += steps
        return Step(made, trees, [], steps, started, started, streamed=plain and callback is not None, scores=scores)

    def one_plain_step(self, target: Engine, rows: "Rows", sampling: Sampling, stats: Stats, started: float,
                       logprobs: bool = False) -> "Step":
        """A plain step: the root alone (an empty accepted path), at plain decoding's cost."""
        trees = [Tree.rooted_at(c[-1]) for c in rows.contexts]
        stats.plain_steps += 1
        if rows.constraints is not None:  # the root alone through verification, which masks its logits
            return self.masked_plain_step(target, rows, trees, sampling, stats, started, logprobs)
        tokens, hidden, scores = plain_step(target, rows.contexts, rows.pos, sampling, bool(self.features), logprobs)
        self.drafter.accepted([[] if row_live else None for row_live in rows.live], trees, rows.pos, hidden)
        stats.target_forwards += 1
        return Step([[token] if row_live else None for token, row_live in zip(tokens, rows.live)], trees, [], 1,
                    started, started, scores=[[row] for row in scores] if logprobs else None)

    def masked_plain_step(self, target: Engine, rows: "Rows", trees: list, sampling: Sampling, stats: Stats,
                          started: float, logprobs: bool = False) -> "Step":
        """A plain step of constrained rows: each root's logits masked by its grammar (verification of a lone root)."""
        trees, masks = constrain(trees, rows.constraints, rows.live)
        results = verify_step(target, trees, rows.pos, sampling, rows.live, bool(self.features), logprobs, masks)
        results, hidden = results if self.features else (results, None)
        self.drafter.accepted([[] if result else None for result in results], trees, rows.pos, hidden)
        stats.target_forwards += 1
        return Step([[result[1]] if result else None for result in results], trees, [], 1, started, started,
                    scores=[result and list(result[2]) for result in results] if logprobs else None)

    def speculative_step(self, target: Engine, rows: "Rows", arm: tuple, sampling: Sampling, stats: Stats,
                         started: float, after_plain: bool, logprobs: bool = False) -> "Step":
        """Draft a tree per row (`arm`: depth, nodes), verify them all in one target forward, accept a path per row
        and tell the drafter."""
        drafter = self.drafter
        trees, forwards = drafter.draft([c[-1] for c in rows.contexts], rows.pos, arm[0], rows.contexts, sampling,
                                        **({"nodes": arm[1]} if self.auto else {}))
        if self.auto:  # the draft's own seconds (on CUDA, a sync; otherwise draft and verification queue)
            synchronize(target.model)
        # drafts a row's grammar forbids cut (before the timing: a cost of the draft)
        trees, masks = constrain(trees, rows.constraints, rows.live)
        drafted = time.perf_counter()
        caught_up = getattr(drafter, "caught_up", 0.0)
        if after_plain and caught_up > started:  # reading the plain steps' tokens is the cost of switching,
            started = caught_up                    # not of this arm: not priced in it
        results = verify_step(target, [tree.pad_to(arm[1] + 1) for tree in trees], rows.pos, sampling, rows.live,
                              bool(self.features), logprobs, masks)
        results, hidden = results if self.features else (results, None)
        paths = [result[0] if result else None for result in results]
        drafter.accepted(paths, trees, rows.pos, hidden)
        stats.draft_forwards += forwards
        stats.target_forwards += 1
        news = []
        for b, result in enumerate(results):
            if result is None:
                news.append(None)
                continue
            path, next_token = result[:2]
            stats.accept_counts[len(path)] += 1
            stats.drafted += arm[0]
            news.append([trees[b].tokens[node] for node in path] + [next_token])
        scores = [result and list(result[2]) for result in results] if logprobs else None
        return Step(news, trees, paths, 1, started, drafted, scores=scores)


@dataclass
class Step:
    """What one step of the loop decided, for the rows' bookkeeping and the choice's timing."""
    news: list  # each row's new tokens (None: nothing for that row)
    trees: list  # the trees verified (roots alone for plain steps)
    paths: list  # the accepted paths (empty for plain steps)
    steps: int  # target forwards taken
    started: float  # when the step's own work began (perf_counter)
    drafted: float  # when its draft was ready
    streamed: bool = False  # its tokens already went to the callback
    scores: Optional[list] = None  # with logprobs: each row's target log-probabilities [V] per new token


class Rows:
    """Each row's state in the speculative loop: its new tokens, the slot of its current token, its context, and
    whether it still runs. A finished row idles: its context stays as it was. A row with a grammar (constraints[b])
    hands it each token it keeps, and ends where the grammar does."""

    def __init__(self, prompts: list, outs: list, max_new_tokens: int, eos: set, stop_at_eos: bool,
                 constraints: Optional[list] = None):
        self.outs, self.max_new_tokens, self.eos, self.stop_at_eos = outs, max_new_tokens, eos, stop_at_eos
        self.constraints = constraints
        self.pos = [len(p) for p in prompts]  # each row's slot of its current token (last accepted, not yet cached)
        self.live = [not self.finished(out, b) for b, out in enumerate(outs)]
        self.contexts = [p + out for p, out in zip(prompts, outs)]

    def finished(self, out: list, b: int) -> bool:
        ended = self.constraints is not None and self.constraints[b] is not None and self.constraints[b].ended
        return ended or len(out) >= self.max_new_tokens or (self.stop_at_eos and out[-1] in self.eos)

    def taken(self, out: list, new: list) -> int:
        """How many of a row's new tokens it keeps: up to its end (the length, or EOS where it stops there)."""
        return next((i + 1 for i, t in enumerate(new)
                     if len(out) + i + 1 >= self.max_new_tokens or (self.stop_at_eos and t in self.eos)), len(new))

    def extend(self, news: list, callback=None, scores: Optional[list] = None):
        """Each live row's new tokens kept up to its end (and streamed to `callback`, with each one's scores where
        given); a row that ends stops."""
        for b, new in enumerate(news):
            if new is None or not self.live[b]:
                continue
            new = new[:self.taken(self.outs[b], new)]
            constraint = self.constraints[b] if self.constraints is not None else None
            kept = []
            # the grammar takes each token before the callback sees it (it may end the loop)
            for i, t in enumerate(new):
                if constraint is not None and not constraint.accept(t):  # a dead end: no token, the row ends
                    break
                kept.append(t)
                if callback:
                    callback(torch.tensor([t]), scores[b][i]) if scores else callback(torch.tensor([t]))
            new = kept
            self.outs[b] += new
            if self.finished(self.outs[b], b):
                self.live[b] = False
            else:
                self.pos[b] += len(new)
                self.contexts[b] += new


def plain_step(target: Engine, contexts: list, pos: list, sampling: Sampling, features: bool = False,
               logprobs: bool = False):
    """A plain step of every row inside the loop (run_plain_steps): each row's current token through the target's
    forward. Returns each row's next token, with `features` the target's features at the current token [B, 1, F]
    and with `logprobs` its log-probabilities [B, V] (else None each). Finished rows step too (the shape stays
    fixed); their tokens are ignored."""
    device = target.model.tok_embeddings.weight.device
    tokens, hidden, scores = run_plain_steps(target, torch.tensor([c[-1] for c in contexts], device=device), pos, 1,
                                             sampling, features, logprobs)
    return tokens[0].tolist(), hidden[0] if features else None, scores[0] if logprobs else None


def run_plain_steps(target: Engine, token: Tensor, pos: list, steps: int, sampling: Sampling, features: bool = False,
                    logprobs: bool = False):
    """`steps` plain steps of every row after `token` [B] at positions `pos`, as plain decoding's loop runs them: the
    causal mask made on the device, one draw for the batch, no host work between tokens (per-row tree masks and
    verification made a plain step cost more than plain decoding's), non-finite logits looked for every
    EOS_CHECK_EVERY tokens as plain decoding does. Returns the tokens ([B] per step) and, with `features`, the
    target's features at each step's input ([B, 1, F] per step), the head's entries for these tokens, and with
    `logprobs` the target's log-probabilities at each step's token ([B, V] per step, target_logprobs)."""
    model = target.model
    device = model.tok_embeddings.weight.device
    batch = token.shape[0]
    x = token.view(batch, 1)
    input_pos = torch.tensor(pos, device=device).view(-1, 1)  # [B, 1]
    cache_slots = torch.arange(model.max_seq_length, device=device).view(1, 1, 1, -1)
    tokens, kept, scores, finite = [], [], [], torch.ones(batch, dtype=torch.bool, device=device)
    with sdpa_context():
        for i in range(steps):
            at = input_pos + i
            # the causal mask passed as verification passes its tree's: every mode's graphs see one signature
            mask = cache_slots <= at.view(-1, 1, 1, 1)
            if features:
                logits, hidden = target.forward_features(x, at, at, mask)  # [B, 1, V], [B, 1, F]
                kept.append(hidden.clone())  # a CUDA graph's replay overwrites its outputs
            else:
                logits = target.forward(x, at, at, mask)
            if logprobs:
                scores.append(target_logprobs(logits[:, -1]))
            token, probs = sample(logits[:, -1], sampling)
            finite &= chosen_is_finite(logits[:, -1] if probs is None else probs, token)
            x = token.view(batch, 1)
            tokens.append(token.clone())
            if ((i + 1) % EOS_CHECK_EVERY == 0 or i + 1 == steps) and not bool(finite.all()):
                raise non_finite_logits(model, "for a generated token")
    return tokens, kept, scores


def plain_step_seconds(target: Engine, contexts: list, pos: list, sampling: Sampling, features: bool = False) -> float:
    """Seconds of one plain step of the whole batch (plain_step, which writes only the cache slots the next step
    writes again with the same values): the quickest of the calls after the first (which may compile the graph)."""
    seconds = []
    for _ in range(3):
        synchronize(target.model)
        started = time.perf_counter()
        plain_step(target, contexts, pos, sampling, features)
        synchronize(target.model)
        seconds.append(time.perf_counter() - started)
    return min(seconds[1:])


# ----------------------------------------------------------------------------- n-gram lookup

class Lookup:
    """Draft-free drafting (Lookahead, Zhao et al. 2023): continuations of the current suffix found
    earlier in the context (prompt and output) and in the last MAX_SAMPLES samples of the run, merged into a trie.
    Every 1..n-1-gram's occurrences are indexed as the text grows, so a lookup scans nothing."""
    MAX_SAMPLES = 32  # earlier samples kept (a server's speculator lives for every request it serves)

    def __init__(self, n: int, in_samples: Optional[dict] = None, samples: Optional[collections.deque] = None):
        self.n = n
        # gram (tuple) -> [(an earlier sample's ids, index just after the gram)]
        self.in_samples = {} if in_samples is None else in_samples
        self.samples = collections.deque() if samples is None else samples  # the samples in_samples indexes
        self.context, self.in_context = [], {}

    def fresh(self) -> "Lookup":
        """A lookup for a new generation (one row): its own context, this run's earlier samples."""
        return Lookup(self.n, self.in_samples, self.samples)

    def forget(self):
        """Drop the earlier samples (a benchmark repeating a prompt would copy its own last answer)."""
        self.in_samples.clear()
        self.samples.clear()

    def index(self, where: dict, text: list, start: int):
        for end in range(start + 1, len(text) + 1):
            for size in range(1, min(self.n - 1, end) + 1):
                where.setdefault(tuple(text[end - size:end]), []).append((text, end))

    def finish(self, tokens: list):
        self.samples.append(list(tokens))
        if len(self.samples) <= self.MAX_SAMPLES:
            self.index(self.in_samples, self.samples[-1], 0)
            return
        self.samples.popleft()  # the index again, without the oldest (in place: fresh lookups share it)
        self.in_samples.clear()
        for text in self.samples:
            self.index(self.in_samples, text, 0)

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


class NgramDrafter:
    """The lookup trie's most frequent branches become the tree. Children are chosen deterministically."""
    kind, features = "ngram", ()

    def __init__(self, n: int, depth: int, tree_nodes: int):
        self.depth, self.tree_nodes, self.lookahead = depth, tree_nodes, tree_nodes + 2
        self.lookup = Lookup(n)

    def start(self, prompts: list, max_seq_length: int, features=None) -> int:
        self.lookups = [self.lookup.fresh() for _ in prompts]
        return 0

    def draft(self, roots: list, pos: list, depth: int, contexts: list, sampling: Sampling, nodes=None):
        trees = [self.best_first(root, lookup.trie(context, depth), nodes or self.tree_nodes)
                 for root, lookup, context in zip(roots, self.lookups, contexts)]
        return trees, 0

    def best_first(self, root: int, trie: dict, nodes: int) -> Tree:
        tree = Tree.rooted_at(root)
        frontier = [(-count, 1, token, sub, 0) for token, (count, sub) in trie.items()]
        while frontier and len(tree.tokens) <= nodes:
            frontier.sort(key=lambda f: (f[0], f[1]))
            _, depth, token, sub, parent = frontier.pop(0)
            node = tree.add(token, parent)
            frontier += [(-c, depth + 1, t, s, node) for t, (c, s) in sub.items()]
        return tree

    def accepted(self, paths: list, trees: list, pos: list, features=None):
        pass

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
MAX_AUTO_NODES = 32  # the largest tree `tree_nodes auto` tries


def format_stats(stats: dict) -> str:
    return (f"Acceptance: mean accepted {stats['mean_accepted']:.2f} of K={stats['speculate_k']} "
            f"(rate {stats['acceptance_rate']:.1%}, {stats['tokens_per_target_forward']:.2f} tokens per target "
            f"forward), accept_counts {stats['accept_counts']}, target forwards {stats['target_forwards']}, "
            f"draft forwards {stats['draft_forwards']}")
