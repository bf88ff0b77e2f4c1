"""Speculative decoding for a batch of different prompts (speculate.Speculator.generate at B > 1): every row
keeps its own cache length, acceptance and stop, and equals its prompt decoded alone."""
import json
import time

import pytest
import torch

import decode
import drafthead
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


@pytest.mark.parametrize("drafter", ["draft model", "n-gram", "draft head", "head tree"])
def test_auto_steps_of_any_size_or_plain_keep_every_row(random_target, near_draft, drafter, monkeypatch):
    """Whatever `auto` picks step by step (plain steps, depths, tree sizes, in any order), every row equals its
    prompt decoded alone: the drafters catch up on what plain steps decoded without them."""
    from test_drafthead import random_head
    model = generation.load_model(random_target)
    engine = decode.Engine(model)
    want = alone(engine, BATCH, 30)
    script = [None, (3, 3), None, None, (1, 1), (2, 8), None, (3, 6), (2, 2)]
    head = None
    if drafter == "draft model":  # its tree size is fixed by its graphs: chains only
        speculation, draft = generation.Speculation("auto"), decode.Engine(generation.load_model(near_draft))
        script = [arm if arm is None else (arm[0], arm[0]) for arm in script]
    else:
        speculation, draft = generation.Speculation(3, "auto", 3 if drafter == "n-gram" else 0), None
        if drafter != "n-gram":
            head = random_head(model, 300, seed=2)
            engine = decode.Engine(model, features=head.args.target_layers)
    speculator = generation.make_speculator(speculation, draft, model.args.block_size, head)
    steps = iter(script * 20)
    monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: next(steps))
    got, stats = generation.generate(engine, [list(p) for p in BATCH], 30, decode.Sampling(), [], stop_at_eos=False,
                                     speculator=speculator)
    assert got == want
    assert stats["plain_steps"] >= 3 and sum(stats["accept_counts"]) >= 3


@pytest.mark.parametrize("drafter", ["draft model", "n-gram", "draft head"])
def test_auto_plain_runs_go_through_plain_decoding(random_target, near_draft, drafter, monkeypatch):
    """`auto`'s plain steps come in runs through plain decoding's own loop (decode_n_tokens; a head's, which reads
    the target's features, through run_plain_steps), of any length between speculative steps; rows stop at EOS
    inside a run, a run never passes max_new_tokens, rows that finished make the next plain steps single ones again;
    every row equals its prompt decoded alone, the stats count one target forward per plain token, a stream hands on
    each token once."""
    from test_drafthead import random_head
    model = generation.load_model(random_target)
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return decode.decode_one_token(*args, **kwargs)
    head = random_head(model, 300, seed=2) if drafter == "draft head" else None
    engine = decode.Engine(model, decode_one_token=counted, features=head.args.target_layers if head else ())
    draft = decode.Engine(generation.load_model(near_draft)) if drafter == "draft model" else None
    speculation = generation.Speculation("auto") if draft else generation.Speculation(3, "auto", 0 if head else 3)
    plain = alone(decode.Engine(model), BATCH, 24)
    eos = plain[2][9]  # row 2 meets it inside a run, others maybe too
    for eos_ids in ([eos], []):
        runs, chosen = [], []
        arms, lengths = iter([None, (2, 2), None, None, (1, 1), None, (3, 3)] * 30), iter([4, 1, 7, 2, 5, 3] * 30)
        monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: chosen.append(next(arms)) or chosen[-1])
        monkeypatch.setattr(speculate.AutoChoice, "plain_run",
                            lambda self, limit: runs.append((next(lengths), limit)) or min(runs[-1]))
        speculator = generation.make_speculator(speculation, draft, model.args.block_size, head)
        calls[0] = 0
        got, stats = generation.generate(engine, [list(p) for p in BATCH], 24, decode.Sampling(), eos_ids,
                                         speculator=speculator)
        assert got == [generation.truncate_at_eos(row, set(eos_ids)) for row in plain]
        assert stats["target_forwards"] == 1 + stats["plain_steps"] + sum(arm is not None for arm in chosen)
        assert sum(stats["accept_counts"]) >= 3
        # runs while every row is live, single plain steps (plain_step) once one has finished
        assert head or 8 < calls[0] <= stats["plain_steps"] and (calls[0] < stats["plain_steps"] or not eos_ids)
        if head:  # what the head read at each catch-up: the target's features of the tokens before its slots
            reads = []
            catch_up = drafthead.HeadDrafter.catch_up

            def recording(self, pos, contexts):
                reads.append(([torch.cat(p) if p else None for p in self.pending], list(pos)))
                return catch_up(self, pos, contexts)
            arms, lengths = iter([None, (2, 2), None, None, (1, 1), None, (3, 3)] * 30), iter([4, 1, 7, 2, 5, 3] * 30)
            with monkeypatch.context() as m:
                m.setattr(drafthead.HeadDrafter, "catch_up", recording)
                generation.generate(engine, [list(p) for p in BATCH], 24, decode.Sampling(), eos_ids,
                                    speculator=generation.make_speculator(speculation, None, model.args.block_size,
                                                                          head))
            whole = generation.load_model(random_target)
            whole.setup_caches(1, 64)
            checked = 0
            for b, (prompt, row) in enumerate(zip(BATCH, got)):
                if len(row) < 24:  # a row that ended early keeps its last position; it drafts no more
                    continue
                sequence = torch.tensor([list(prompt) + row])
                _, features = whole.forward_features(sequence, torch.arange(sequence.shape[1]).view(1, -1),
                                                     layers=head.args.target_layers)
                for pending, pos in reads:
                    if pending[b] is not None and len(pending[b]):
                        n = len(pending[b])
                        torch.testing.assert_close(pending[b], features[0, pos[b] - n:pos[b]], atol=1e-4, rtol=1e-4)
                        checked += 1
            assert checked >= 6
    streamed, runs = [], []
    arms, lengths = iter([None, (2, 2), None] * 30), iter([30, 2] * 30)  # the first run cut at max_new_tokens
    got, _ = generation.generate(engine, [list(BATCH[1])], 24, decode.Sampling(), [],
                                 stop_at_eos=False, speculator=speculator, callback=lambda t: streamed.extend(t.tolist()))
    assert got[0] == streamed == alone(decode.Engine(model), BATCH[1:2], 24)[0]
    assert runs[0] == (30, 23)


def test_a_generation_that_never_drafts_never_runs_the_draft_model(random_target, near_draft, monkeypatch):
    model, draft_model = generation.load_model(random_target), generation.load_model(near_draft)
    runs = []
    draft_model.layers[0].register_forward_hook(lambda *_: runs.append(1))
    monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: None)
    speculator = generation.make_speculator(generation.Speculation("auto"), decode.Engine(draft_model),
                                            model.args.block_size)
    got, stats = generation.generate(decode.Engine(model), [list(p) for p in BATCH], 20, decode.Sampling(), [],
                                     stop_at_eos=False, speculator=speculator)
    assert got == alone(decode.Engine(model), BATCH, 20)
    assert runs == [] and stats["draft_forwards"] == 0


def test_a_draft_models_catch_up_after_plain_steps_is_not_priced_in_the_next_arm(random_target, near_draft,
                                                                                  monkeypatch):
    """After plain steps a draft model first reads the tokens they made (one forward; at the first draft, the prompt
    too: a generation that never drafts never runs the draft): the cost of switching from plain steps, paid once,
    not of the arm drafted next; priced in it, an arm tried after a long plain run would look as slow as that run
    was long, and `auto` would stay plain."""
    model = generation.load_model(random_target)
    draft = decode.Engine(generation.load_model(near_draft))
    slow_reads = []

    def write_cache(x, input_pos):
        if x.shape[1] > 1:  # a catch-up of several tokens
            slow_reads.append(x.shape[1])
            time.sleep(0.3)
        return decode.Engine.write_cache(draft, x, input_pos)
    monkeypatch.setattr(draft, "write_cache", write_cache)
    arms, observed = iter([None] * 3 + [(2, 2)] * 40), []
    monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: next(arms))
    monkeypatch.setattr(speculate.AutoChoice, "plain_run", lambda self, limit: min(limit, 6))
    observe = speculate.AutoChoice.observe
    monkeypatch.setattr(speculate.AutoChoice, "observe", lambda self, arm, trees, paths, draft_seconds, *a, **k:
                        observed.append((arm, draft_seconds)) or observe(self, arm, trees, paths, draft_seconds, *a, **k))
    speculator = generation.make_speculator(generation.Speculation("auto"), draft, model.args.block_size)
    got, _ = generation.generate(decode.Engine(model), [list(BATCH[1])], 30, decode.Sampling(), [], stop_at_eos=False,
                                 speculator=speculator)
    assert got == alone(decode.Engine(model), BATCH[1:2], 30)
    # one forward at the first draft: the prompt and the plain runs' 18 tokens, all but the last (fed with the root)
    assert slow_reads == [len(BATCH[1]) + 18 - 1]
    first_arm = next(seconds for arm, seconds in observed if arm is not None)
    assert first_arm < 0.3


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("drafter", ["n-gram", "draft head"])
def test_plain_steps_inside_the_loop_stop_on_nan_logits(random_target, temperature, drafter, monkeypatch):
    """Plain steps inside the speculative loop end the run with the one NaN line when the logits go NaN: a run of
    plain steps looks as plain decoding does, every EOS_CHECK_EVERY tokens (FiniteWatch; with a drafter reading
    features, the chosen token's logit or probability: argmax picks a NaN, NaN makes every probability NaN)."""
    from test_drafthead import random_head
    model = generation.load_model(random_target)
    calls = [0]

    def hook(_module, _inputs, out):  # the prefill and the three timed plain forwards pass; every later one is NaN
        calls[0] += 1
        return out * float("nan") if calls[0] > 4 else out
    model.layers[0].register_forward_hook(hook)
    head = random_head(model, 300, seed=2) if drafter == "draft head" else None
    engine = decode.Engine(model, features=head.args.target_layers if head else ())
    speculator = generation.make_speculator(generation.Speculation("auto", None, 0 if head else 2), None,
                                            model.args.block_size, head)
    monkeypatch.setattr(speculate.AutoChoice, "choose", lambda self, batch: None)
    with pytest.raises(generation.UserError, match="NaN"):
        generation.generate(engine, [list(p) for p in BATCH], 20, decode.Sampling(temperature), [],
                            stop_at_eos=False, speculator=speculator)
    assert calls[0] == 4 + decode.EOS_CHECK_EVERY


def test_auto_choice_uses_a_timing_once_a_second_replaces_the_first():
    auto = speculate.AutoChoice([(1, 1), (2, 2)])
    auto.timed(auto.verify_seconds, (1, 3), 20.0)  # a first call: not used yet
    assert auto.verify_cost(1, 3) == 0.0 and auto.measured(auto.verify_seconds) == {}
    auto.timed(auto.verify_seconds, (1, 3), 1.0)  # the second replaces it outright, then the average takes over
    auto.timed(auto.verify_seconds, (1, 3), 2.0)
    assert auto.verify_cost(1, 3) == pytest.approx(1.0 * (1 - auto.EMA) + 2.0 * auto.EMA)
    auto.timed(auto.verify_seconds, (1, 1), 0.5, warm=True)  # plain_step_seconds times warm calls: used at once
    assert auto.verify_cost(1, 1) == 0.5
    auto.timed(auto.draft_seconds, (2, 2), 30.0)
    auto.timed(auto.draft_seconds, (1, 1), 0.2)
    auto.timed(auto.draft_seconds, (1, 1), 0.1)
    assert auto.draft_cost((2, 2)) == pytest.approx(0.2)  # priced from the measured arm, not its first call


def test_auto_choice_prices_no_width_above_a_wider_one_measured():
    """A plain step timed once in a slow moment (and never again, while drafts seem to win) costs at most a little
    more than a width-2 verification measured: `auto` can still find that plain steps win."""
    auto = speculate.AutoChoice([(1, 1), (2, 2)])
    auto.timed(auto.verify_seconds, (1, 1), 1.8, warm=True)  # the start's plain step, slow
    auto.timed(auto.verify_seconds, (1, 2), 1.3, warm=True)
    auto.timed(auto.verify_seconds, (1, 4), 2.0, warm=True)
    assert auto.verify_cost(1, 1) == pytest.approx(1.3 * auto.WIDER_SLACK) and auto.verify_cost(1, 2) == 1.3
    assert auto.verify_cost(1, 3) == pytest.approx(1.65) and auto.verify_cost(1, 4) == 2.0
    auto.timed(auto.draft_seconds, (1, 1), 0.4, warm=True)
    auto.timed(auto.draft_seconds, (2, 2), 0.8, warm=True)
    auto.accepted[1:] = [0.1 * auto.reached[1], 0.1 * auto.reached[2]]  # drafts rarely accepted
    assert auto.choose(1) is None  # 1 / 1.43 beats (1 + 0.1) / (0.4 + 1.3); priced at 1.8 it would not
    auto.verify_seconds[(1, 1)] = 1.35  # within the slack of a wider width: as measured
    assert auto.verify_cost(1, 1) == 1.35


def test_auto_choice_timings_are_kept_and_a_bad_file_is_ignored_with_one_line(tmp_path, capsys, monkeypatch):
    """StoredCosts: an AutoChoice's trusted timings round-trip through the file and are used at once by the next
    one; first timings are not kept; a file of another key, or with impossible or non-numeric timings, is ignored
    with one line; an unchanged set of timings is not rewritten at every generation; an unwritable place is one
    line, never an exception."""
    path = tmp_path / "compiled" / "auto-timings.json"
    auto = speculate.AutoChoice([(1, 1), (2, 2)])
    auto.store = speculate.StoredCosts(path, "k1")
    auto.timed(auto.verify_seconds, (1, 1), 0.5, warm=True)
    auto.timed(auto.verify_seconds, (1, 3), 9.0)  # a first timing: not trusted, not kept
    auto.timed(auto.draft_seconds, (2, 2), 0.25, warm=True)
    auto.finished()
    stored = json.loads(path.read_text())
    assert stored["verify"] == [[1, 1, 0.5]] and stored["draft"] == [[2, 2, 0.25]] and stored["key"] == "k1"
    later = speculate.AutoChoice([(1, 1), (2, 2)])
    later.store = speculate.StoredCosts(path, "k1")
    later.seed(later.store.load())
    assert later.verify_cost(1, 1) == 0.5 and later.draft_cost((2, 2)) == 0.25 and later.draft_cost((1, 1)) == 0.125
    assert capsys.readouterr().err == ""
    assert speculate.StoredCosts(path, "k2").load() is None  # another configuration's
    assert capsys.readouterr().err.count("\n") == 1
    for bad in ('{"key": "k1", "verify": [[1, 1, NaN]], "draft": []}', '{"key": "k1", "verify": [[1, 1, -1]], '
                '"draft": []}', '{"key": "k1", "verify": [["a", 1, 1]]}', '[1, 2]', '{"key": "k1"', "\xff"):
        path.write_text(bad)
        assert speculate.StoredCosts(path, "k1").load() is None, bad
        err = capsys.readouterr().err
        assert err.startswith("ignoring the stored timings") and err.count("\n") == 1, err
    store = speculate.StoredCosts(path, "k1")
    writes = []
    monkeypatch.setattr(speculate, "write_atomically", lambda p, fn: writes.append(p) or fn(p))
    for _ in range(3):
        store.save(auto.costs())
    auto.timed(auto.verify_seconds, (1, 2), 0.6, warm=True)  # a new width: written at once
    store.save(auto.costs())
    assert len(writes) == 2 and json.loads(path.read_text())["verify"] == [[1, 1, 0.5], [1, 2, 0.6]]

    def unwritable(p, fn):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(speculate, "write_atomically", unwritable)
    store = speculate.StoredCosts(path, "k1")
    store.save(auto.costs())
    store.save(auto.costs())
    err = capsys.readouterr().err
    assert err.startswith("could not keep the timings") and err.count("\n") == 1


def test_auto_choice_plain_run_takes_the_plain_steps_before_the_next_exploration():
    """plain_run: where plain steps win, the steps up to the next exploration taken at once (at most the limit);
    the step after them explores with the cheapest arm, as step-by-step plain choices would."""
    auto = speculate.AutoChoice([(1, 1), (2, 2)])
    auto.timed(auto.verify_seconds, (1, 1), 1.0, warm=True)
    auto.timed(auto.verify_seconds, (1, 2), 5.0, warm=True)
    auto.timed(auto.draft_seconds, (1, 1), 5.0, warm=True)
    stepwise = [auto.choose(1) for _ in range(auto.EXPLORE_EVERY + 1)]
    assert stepwise == [None] * auto.EXPLORE_EVERY + [(1, 1)]
    auto = speculate.AutoChoice([(1, 1), (2, 2)])
    auto.timed(auto.verify_seconds, (1, 1), 1.0, warm=True)
    auto.timed(auto.verify_seconds, (1, 2), 5.0, warm=True)
    auto.timed(auto.draft_seconds, (1, 1), 5.0, warm=True)
    assert auto.choose(1) is None and auto.plain_run(3) == 3  # capped by the limit
    assert auto.choose(1) is None and auto.plain_run(100) == auto.EXPLORE_EVERY - 3
    assert auto.choose(1) == (1, 1)
    auto.observe(None, [], [], 0.0, 8.0, 1, steps=8)  # eight plain steps' seconds: one step's cost is an eighth
    assert auto.verify_cost(1, 1) == pytest.approx(0.8 * 1.0 + 0.2 * 1.0)


def test_auto_choice_follows_measured_costs_and_acceptance():
    """AutoChoice picks plain steps where drafts are rejected, deep chains where they are accepted and verification
    is cheap, and in between the depth a brute-force computation of tokens per second picks."""
    arms = speculate.auto_arms(8, None, True, False, 8)

    def run(accept: float, width_cost: float, steps: int = 300, first_call: float = 1.0, draft_fixed=0.0) -> list:
        auto, rng, picks, seen = speculate.AutoChoice(arms), torch.Generator().manual_seed(0), [], set()
        auto.timed(auto.verify_seconds, (1, 1), 1.0, warm=True)  # as plain_step_seconds times it
        for _ in range(steps):
            arm = auto.choose(1)
            picks.append(arm)
            if arm is None:
                auto.observe(None, [], [], 0.0, 1.0, 1)
                continue
            k = arm[0]
            accepted = 0
            while accepted < k and float(torch.rand((), generator=rng)) < accept:
                accepted += 1
            tree = speculate.Tree.rooted_at(0, 0)
            for d in range(k):
                tree.add(0, d)
            slow = first_call if arm not in seen else 1.0  # a first call's one-time costs
            seen.add(arm)
            auto.observe(arm, [tree], [list(range(1, accepted + 1))], (draft_fixed + 0.05 * k) * slow,
                         (1.0 + width_cost * k) * slow, 1)
        return picks[100:]

    rejected = run(0.0, 0.5)
    assert rejected.count(None) >= 0.8 * len(rejected)
    # a draft whose fixed cost makes plain steps win although deep chains are its best: explored with the
    # cheapest arm, not the best
    costly = run(0.5, 0.0, draft_fixed=3.0)
    assert costly.count(None) >= 0.8 * len(costly)
    assert {arm for arm in costly if arm is not None} == {(1, 1)}
    cheap = run(0.95, 0.0)
    assert all(arm is not None and arm[0] >= 6 for arm in cheap[-50:])

    def rate(k, a=0.7, width_cost=0.1):
        return sum(a ** i for i in range(k + 1)) / (0.05 * k + 1.0 + width_cost * k)
    best = max(range(1, 9), key=rate)
    middle = [arm[0] for arm in run(0.7, 0.1) if arm is not None]
    assert sum(rate(k) for k in middle) / len(middle) >= 0.95 * rate(best)
    # every arm's first step 20x slower (a graph loaded, a width's first run): no arm is priced out by it
    for accept, width_cost in ((0.7, 0.1), (0.9, 0.02)):
        best = max(range(1, 9), key=lambda k: rate(k, accept, width_cost))
        picks = [arm[0] for arm in run(accept, width_cost, first_call=20.0) if arm is not None]
        assert sum(rate(k, accept, width_cost) for k in picks) / len(picks) >= 0.95 * rate(best, accept, width_cost)


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
