"""A draft with another tokenizer (crossdraft.py) against our plain decode and transformers' assisted generation
across tokenizers (generate(assistant_model=..., tokenizer=..., assistant_tokenizer=...)), greedy and sampled.

    python scripts/bench_crossdraft.py                       # train_tiny.py's OUT/draft_othertok
    python scripts/bench_crossdraft.py --draft revocab       # builds OUT/draft_revocab once, then measures
    python scripts/bench_crossdraft.py --new_tokens 100 --temperatures 0,0.7 --no_compile

The pair: train_tiny.py's target and one of two drafts of another tokenizer. "trained" (the default):
OUT/draft_othertok, trained by train_tiny.py from scratch with a sentencepiece vocabulary of its own (3/4 of
the target's size, digits kept together) on the same text. "revocab": the distilled draft behind a tokenizer
written once to OUT/draft_revocab: the draft's sentencepiece pieces with a third of the multi-character ones
removed (so many strings split differently: "ing" becomes "i" "n" "g") and every id reshuffled, as a
tokenizer.json (Metaspace BPE), the embedding and output rows moved with their pieces; a draft that imitates
the target, so its acceptance is an upper end of what a cross-tokenizer pair gets. Neither is a model of
another family.
Rows: plain decoding, the chain of depth --k and `--speculate_k auto` (the depth, or a plain step, chosen per step).
Prompts: the opening lines of held-out standard-library files. Runs take turns (benchlib.time_interleaved).
"""
import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import interruptible_imports, run_cli, write_files_atomically  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT  # noqa: E402
import decode  # noqa: E402
import generation  # noqa: E402
import tokenizer as tokenizers_  # noqa: E402
from bench_speculative import load_prompts  # noqa: E402


def write_other_tokenizer_draft(pair: Path, seed: int = 0) -> Path:
    """OUT/draft_revocab/model.pth: the distilled draft behind a pruned, reshuffled vocabulary (see the docstring)."""
    out = pair / "draft_revocab"
    if (out / "model.pth").is_file():
        return out / "model.pth"
    source = tokenizers_.get_tokenizer(pair / "draft")
    spec = json.loads(source.processor.to_str())
    vocab = spec["model"]["vocab"]
    rng = random.Random(seed)
    special = {token for token in source.processor.get_added_tokens_decoder()}
    kept = [p for p, i in sorted(vocab.items(), key=lambda kv: kv[1])
            if i in special or len(p) < 2 or p.startswith("<0x") or rng.random() > 1 / 3]
    order = [p for p in kept if vocab[p] not in special]
    rng.shuffle(order)
    new_vocab = {p: i for i, p in enumerate([p for p in kept if vocab[p] in special] + order)}
    assert all(new_vocab[p] == vocab[p] for p in kept if vocab[p] in special)  # specials keep their ids
    spec["model"]["vocab"] = new_vocab
    spec["model"]["merges"] = [[a, b] for a, b in tokenizers_.bpe_merges({p: vocab[p] for p in kept})]
    state = torch.load(pair / "draft/model.pth", weights_only=True)
    rows = torch.tensor([vocab[p] for p in sorted(new_vocab, key=new_vocab.get)])
    for name in ("tok_embeddings.weight", "output.weight"):
        state[name] = state[name][rows].clone()
    config = json.loads((pair / "draft/config.json").read_text())
    write_files_atomically(out, {  # model.pth last: the next run takes a directory with one as complete
        "tokenizer.json": lambda tmp: tmp.write_text(json.dumps(spec, ensure_ascii=False)),
        "config.json": lambda tmp: tmp.write_text(json.dumps(dict(config, vocab_size=len(new_vocab)))),
        "model.pth": lambda tmp: torch.save(state, tmp)})
    return out / "model.pth"


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tok.processor, **tok.special_tokens)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, default=ROOT / "checkpoints/tiny", help="train_tiny.py's OUT directory")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt_tokens", type=int, default=96)
    p.add_argument("--new_tokens", type=int, default=100)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--draft", choices=["trained", "revocab"], default="trained",
                   help="trained: OUT/draft_othertok (train_tiny.py); revocab: the distilled draft, re-vocabularied")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--no_transformers", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/crossdraft.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    benchlib.check_counts(args, "prompts", "prompt_tokens", "new_tokens", "k", "repeats", "threads")
    torch.set_num_threads(args.threads or os.cpu_count())
    target_pth, draft_pth = pair_paths(args.pair, args.draft)
    target, draft = generation.load_model(target_pth), generation.load_model(draft_pth)
    target_tok, draft_tok = tokenizers_.get_tokenizer(target_pth.parent), tokenizers_.get_tokenizer(draft_pth.parent)
    text = "    def parse_args(self, args=None, namespace=None):\n"
    print(f"the same text: target {len(target_tok.encode(text))} tokens, draft {len(draft_tok.encode(text))}; "
          f"vocabularies {target_tok.vocab_size} and {draft_tok.vocab_size}", flush=True)
    _, prompts, _ = load_prompts(args.pair, target_tok, args.prompts, args.prompt_tokens, 8)
    mode = "none" if args.no_compile else "auto"  # the target's and the draft's
    engine = decode.compile_engine(target, "cpu", mode)
    draft_engine = decode.compile_engine(draft, "cpu", mode)
    speculators = {f"cross-tokenizer chain K={k}": generation.make_cross_speculator(
        generation.Speculation(k), draft_engine, draft_tok, target_tok, target.args.vocab_size, batch_size=1)
        for k in (args.k, "auto")}
    hf = None
    if not args.no_transformers:
        hf = (benchlib.hf_model(target_pth.parent), benchlib.hf_model(draft_pth.parent),
              hf_tokenizer(target_tok), hf_tokenizer(draft_tok))
    rows = []
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        sampling = decode.Sampling(temperature, top_k=None)
        results = benchlib.time_interleaved(engine, {"plain": None, **speculators}, prompts, args.new_tokens,
                                            sampling, args.repeats)
        rows += our_rows(results, temperature)
        if hf is not None:
            rows += transformers_rows(hf, prompts, results["plain"], temperature, args.new_tokens, args.repeats)
    columns = ["temperature", "impl", "config", "tokens_per_sec", "speedup", "tokens_per_target_forward",
               "same_as_plain"]
    print()
    benchlib.print_table(rows, columns)
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "command": sys.argv,
                                    "settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


def pair_paths(pair: Path, which: str) -> tuple:
    """The target's model.pth and the chosen draft's (the revocab draft written on first use); a missing one is
    refused with the command that makes it."""
    target_pth = pair / "target/model.pth"
    if not target_pth.is_file():
        sys.exit(f"error: {target_pth} not found: train the pair with "
                 f"python scripts/train_tiny.py --out_dir {pair}")
    draft_pth = write_other_tokenizer_draft(pair) if which == "revocab" else pair / "draft_othertok/model.pth"
    if not draft_pth.is_file():
        sys.exit(f"error: {draft_pth} not found: train it with python scripts/train_tiny.py --out_dir {pair}")
    return target_pth, draft_pth


def our_rows(results: dict, temperature: float) -> list:
    """A row per configuration of ours: tokens/s, speedup over plain decoding, tokens per target forward, and
    (greedy) whether its tokens equal plain decoding's."""
    rows = []
    base_tps, base_runs = results["plain"]
    for name, (tps, runs) in results.items():
        row = {"temperature": temperature, "impl": "ours", "config": name, "tokens_per_sec": tps,
               "speedup": tps / base_tps}
        if runs[0][1].get("accept_counts"):
            steps = sum(sum(s["accept_counts"]) for _, s in runs)
            accepted = sum(sum(i * c for i, c in enumerate(s["accept_counts"])) for _, s in runs)
            row["tokens_per_target_forward"] = (accepted + steps) / steps
            if temperature == 0:
                row["same_as_plain"] = all(a == b for (a, _), (b, _) in zip(runs, base_runs))
        rows.append(row)
        print(f"  T={temperature} {name}: {tps:.1f} tok/s, x{row['speedup']:.2f}", flush=True)
    return rows


def transformers_rows(hf: tuple, prompts: list, plain: tuple, temperature: float, new_tokens: int,
                      repeats: int) -> list:
    """transformers' generate(), plain and assisted by the draft across tokenizers, against our plain decoding
    (`plain`: its tokens/s and runs); a configuration that fails is a row with its error."""
    hf_target, hf_draft, hf_target_tok, hf_draft_tok = hf
    base_tps, base_runs = plain
    rows = []
    kwargs = {} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0}
    for name, extra in (("transformers", {}),
                        ("transformers assisted, other tokenizer",
                         {"assistant_model": hf_draft, "tokenizer": hf_target_tok,
                          "assistant_tokenizer": hf_draft_tok})):
        seconds, same = 0.0, True
        try:
            for prompt, (ours, _) in zip(prompts, base_runs):
                tps, ids = benchlib.time_transformers(hf_target, prompt, new_tokens, None, repeats, **kwargs, **extra)
                seconds += len(ids) / tps
                same = same and ids == ours
        except (AttributeError, ValueError, RuntimeError) as e:  # e.g. transformers 5.x sampled assisted
            # generation fails when the assistant's vocabulary lies inside the target's
            rows.append({"temperature": temperature, "impl": "transformers", "config": name,
                         "error": f"{type(e).__name__}: {e}"[:200]})
            print(f"  T={temperature} {name}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        tps = new_tokens * len(prompts) / seconds
        row = {"temperature": temperature, "impl": "transformers", "config": name, "tokens_per_sec": tps,
               "speedup": tps / base_tps}
        if temperature == 0:
            row["same_as_plain"] = same
        rows.append(row)
        print(f"  T={temperature} {name}: {tps:.1f} tok/s, x{row['speedup']:.2f}", flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(run_cli(main))
