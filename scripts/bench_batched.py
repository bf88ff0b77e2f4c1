"""A batch of different prompts: our plain batched decode, speculative decoding (chain, tree, auto) at the same
batch, and transformers' batched generate(), at B = 1, 2, 4, 8, on the tiny pair from scripts/train_tiny.py.

    python scripts/bench_batched.py                          # greedy, compiled, fp32
    python scripts/bench_batched.py --batch_sizes 1,4 --temperature 0.7 --json bench_results/batched_t07.json

Prompts: the opening lines of held-out standard-library files (different lengths). Each row generates exactly
--new_tokens (EOS ignored); tokens/s is the batch's total (B x new_tokens) over the wall time of one
generate() call, prefill included, best of --repeats. Our configurations take turns run by run (a machine
slowing down hurts them alike); greedy rows are checked token for token against plain decoding.
transformers: LlamaForCausalLM with the same weights, left-padded batch with an attention mask, greedy.
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT  # noqa: E402
from bench_speculative import load_prompts  # noqa: E402
import decode  # noqa: E402
import generation  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402


def time_batches(engine, speculators: dict, prompts: list, new_tokens: int, sampling, repeats: int) -> dict:
    """name -> (total tokens/s, rows of the last run, stats of the last run), configurations taking turns, in
    reversed order every other turn (running first in a turn can measure faster than running second)."""
    best, last = {name: float("inf") for name in speculators}, {}
    for turn in range(repeats + 1):  # turn 0 warms up (and compiles)
        for name, speculator in list(speculators.items())[::1 if turn % 2 else -1]:
            torch.manual_seed(0)
            if speculator is not None:  # no copying the last turn's answers to the same prompts
                speculator.forget()
            start = time.perf_counter()
            rows, stats = generation.generate(engine, [list(p) for p in prompts], new_tokens, sampling, eos_ids=[],
                                              stop_at_eos=False, speculator=speculator)
            if turn:
                best[name] = min(best[name], time.perf_counter() - start)
            last[name] = (rows, stats)
    return {name: (sum(map(len, last[name][0])) / best[name], *last[name]) for name in speculators}


@torch.no_grad()
def decode_padded(engine, prompts: list, new_tokens: int, left: bool) -> list:
    """Greedy decode of rows of different prompt lengths, one of two cache layouts (both through engine.forward, the
    compiled multi-token graph with an explicit mask, so that only the layout differs):
    per-row positions (what generate() does): row b's prompt at slots 0..len_b - 1, right-padded, its step i at slot
    len_b + i = its RoPE position, seeing slots <= its own;
    left padding (what transformers does): row b's prompt at slots pad_b..T - 1 (pad_b = T - len_b), every row's
    step i at slot T + i, RoPE position slot - pad_b, the mask hiding slots < pad_b (a padding query sees itself, so
    no row of the attention is empty). Returns the new ids per row."""
    model = engine.model
    batch, width = len(prompts), max(map(len, prompts))
    lengths = torch.tensor([len(p) for p in prompts]).view(batch, 1)  # [B, 1]
    pad = width - lengths if left else torch.zeros_like(lengths)  # [B, 1]
    model.setup_caches(batch, width + new_tokens + 1)
    cache = torch.arange(model.max_seq_length).view(1, 1, -1)  # [1, 1, S]

    def mask_for(slots):  # [B, 1, t, S]
        seen = (cache >= pad.unsqueeze(-1)) | (cache == slots.unsqueeze(-1))
        return (seen & (cache <= slots.unsqueeze(-1))).unsqueeze(1)

    rows = [[0] * (width - len(p)) + list(p) if left else list(p) + [0] * (width - len(p)) for p in prompts]
    slots = torch.arange(width).expand(batch, width)  # [B, T]
    logits = model(torch.tensor(rows), (slots - pad).clamp_min(0), slots, mask_for(slots))  # prefill, eager
    last = slots[:, -1:] if left else lengths - 1  # [B, 1]: each row's last prompt slot
    token = logits.gather(1, last.unsqueeze(-1).expand(batch, 1, logits.shape[-1]))[:, 0].argmax(-1)  # [B]
    out = [token]
    for _ in range(new_tokens - 1):
        last = last + 1
        token = engine.forward(token.view(batch, 1), last - pad, last, mask_for(last))[:, -1].argmax(-1)
        out.append(token)
    return torch.stack(out, 1).tolist()  # [B, new_tokens]


def compare_padding(engine, prompts: list, sizes: list, new_tokens: int, repeats: int) -> list:
    """Total tokens/s of decode_padded's two layouts at each batch size, taking turns; and whether each decodes
    generate()'s greedy ids."""
    rows = []
    for batch in sizes:
        best, ids = {"per-row positions": float("inf"), "left padding": float("inf")}, {}
        for turn in range(repeats + 1):  # turn 0 warms up (and compiles)
            for name in best:
                start = time.perf_counter()
                ids[name] = decode_padded(engine, prompts[:batch], new_tokens, left=name == "left padding")
                if turn:
                    best[name] = min(best[name], time.perf_counter() - start)
        plain = generation.generate(engine, [list(p) for p in prompts[:batch]], new_tokens, decode.Sampling(), [],
                                    stop_at_eos=False)[0]
        per_row = batch * new_tokens / best["per-row positions"]
        for name, seconds in best.items():
            rows.append({"batch": batch, "layout": name, "tokens_per_sec": batch * new_tokens / seconds,
                         "vs_per_row": batch * new_tokens / seconds / per_row,
                         "same_as_generate": ids[name] == plain})
        print(", ".join(f"B={batch} {r['layout']} {r['tokens_per_sec']:.1f}" for r in rows[-2:]), flush=True)
    return rows


def time_transformers_batch(model, prompts: list, new_tokens: int, repeats: int) -> float:
    """Total tokens/s of transformers' greedy generate() on the left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])  # [B, T], left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, T]

    def run():
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)

    return len(prompts) * new_tokens / benchlib.best_seconds(run, repeats)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", type=Path, default=ROOT / "checkpoints/tiny", help="train_tiny.py's OUT directory")
    p.add_argument("--batch_sizes", default="1,2,4,8")
    p.add_argument("--prompt_tokens", type=int, default=96)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5, help="draft depth for chain and tree")
    p.add_argument("--tree_nodes", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--autotune", action="store_true",
                   help="compile as generate.py --compile autotune does (whole graphs, autotuned GEMM kernels)")
    p.add_argument("--only", default=None, help="comma-separated speculative configurations to run beside plain "
                                                 "(default: chain K=5, tree N=16 K=5, chain K=auto; '' for none)")
    p.add_argument("--no_transformers", action="store_true")
    p.add_argument("--padding", action="store_true",
                   help="only compare the two cache layouts for rows of different lengths (per-row positions against "
                        "left padding with a mask), plain greedy decode; writes --json "
                        "(default bench_results/padding.json)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    p.add_argument("--json", type=Path, default=None, help="default bench_results/batched.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    benchlib.check_counts(args, "prompt_tokens", "new_tokens", "k", "tree_nodes", "repeats", "threads")
    torch.set_num_threads(args.threads or os.cpu_count())
    torch._dynamo.config.cache_size_limit = 64
    target_pth, draft_pth = args.pair / "target/model.pth", args.pair / "draft/model.pth"
    for path in (target_pth, draft_pth):
        if not path.is_file():
            sys.exit(f"error: {path} not found: train the pair with python scripts/train_tiny.py --out_dir {args.pair}")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    target, draft = generation.load_model(target_pth), generation.load_model(draft_pth)
    tokenizer = get_tokenizer(args.pair / "target")
    files, prompts, _ = load_prompts(args.pair, tokenizer, max(sizes), args.prompt_tokens, 64)
    prompts = [p[: len(p) - 7 * i] for i, p in enumerate(prompts)]  # different lengths, whatever the files
    mode = "none" if args.no_compile else "autotune" if args.autotune else "auto"  # the draft's too
    engine = decode.compile_engine(target, "cpu", mode)
    settings = {k: str(v) for k, v in vars(args).items()}
    if args.padding:
        rows = compare_padding(engine, prompts, sizes, args.new_tokens, args.repeats)
        print()
        benchlib.print_table(rows, ["batch", "layout", "tokens_per_sec", "vs_per_row", "same_as_generate"])
        benchlib.write_json(args.json or ROOT / "bench_results/padding.json",
                            {"machine": benchlib.machine(), "command": sys.argv,
                             "prompt_lengths": list(map(len, prompts)), "settings": settings, "rows": rows})
        return
    hf_target = None if args.no_transformers else benchlib.hf_model(args.pair / "target")
    k, nodes = args.k, args.tree_nodes
    configs = {f"chain K={k}": (k, None), f"tree N={nodes} K={k}": (k, nodes), "chain K=auto": ("auto", None)}
    configs = benchlib.pick(configs, args.only)
    draft_engine = decode.compile_engine(draft, "cpu", mode) if configs else None
    rows = []
    for batch in sizes:
        rows += batch_rows(engine, draft_engine, configs, hf_target, prompts[:batch], args)
    columns = ["batch", "config", "tokens_per_sec", "vs_plain", "vs_transformers", "tokens_per_target_forward",
               "plain_steps", "same_as_plain"]
    print()
    benchlib.print_table(rows, columns)
    benchlib.write_json(args.json or ROOT / "bench_results/batched.json",
                        {"machine": benchlib.machine(), "command": sys.argv, "prompt_files": [str(f) for f in files],
                         "prompt_lengths": list(map(len, prompts)), "settings": settings, "rows": rows})


def batch_rows(engine, draft_engine, configs: dict, hf_target, prompts: list, args) -> list:
    """The batch of `prompts` decoded plain and by each speculative configuration (name -> (depth, tree nodes)),
    taking turns, and by transformers where given: a row each."""
    batch, sampling = len(prompts), decode.Sampling(args.temperature)
    speculators = {"plain": None}
    for name, (depth, n) in configs.items():
        speculators[name] = generation.make_speculator(generation.Speculation(depth, n), draft_engine,
                                                       max_seq_length=4096)
    results = time_batches(engine, speculators, prompts, args.new_tokens, sampling, args.repeats)
    plain_tps, plain_rows, _ = results["plain"]
    hf_tps = time_transformers_batch(hf_target, prompts, args.new_tokens, args.repeats) \
        if hf_target is not None else None
    rows = []
    for name, (tps, out, stats) in results.items():
        row = {"batch": batch, "config": name, "tokens_per_sec": tps, "vs_plain": tps / plain_tps,
               "vs_transformers": tps / hf_tps if hf_tps else None,
               "tokens_per_target_forward": stats.get("tokens_per_target_forward"),
               "plain_steps": stats.get("plain_steps") if name == "chain K=auto" else None}
        if args.temperature == 0:
            row["same_as_plain"] = out == plain_rows
        rows.append(row)
    if hf_tps:
        rows.append({"batch": batch, "config": "transformers generate()", "tokens_per_sec": hf_tps,
                     "vs_plain": hf_tps / plain_tps, "vs_transformers": 1.0})
    print(f"B={batch}: " + ", ".join(f"{r['config']} {r['tokens_per_sec']:.1f}" for r in rows), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(run_cli(main))
