"""Speculative, tree and n-gram decoding against our plain decode and transformers (plain and assisted
generation), in one process run, on the tiny pair from scripts/train_tiny.py.

    python scripts/bench_speculative.py                      # greedy and T=0.7, compiled, fp32
    python scripts/bench_speculative.py --precision bf16 --json bench_results/speculative_bf16.json
    python scripts/bench_speculative.py --checkpoint_dir checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct  # a real model

With --checkpoint_dir (a real model with a draft head trained by scripts/train_draft_head.py in DIR/head): held-out
chat questions at T = 0 and 0.7, our plain decode, the model's own int4 and int4-a8 copies as drafts, n-gram drafts,
the head's chains and trees (a sweep of depths and sizes) and `auto`, a copy-heavy prompt, a batch of 4 questions, and
llama.cpp's plain decode of the GGUF (Q4_1 and Q8_0) beside them; see real_model().

Prompts: the opening lines of held-out standard-library files (OUT/heldout_files.txt, never trained on).
Copy task (for --draft_ngram): a prompt holding a held-out file's text, then its first lines again, so the
continuation repeats the file, as in code editing or retrieval-grounded answers.
Configurations: plain decoding, the draft's chain, its trees (--tree_nodes), the tree with the n-gram
lookup's branches merged in, the adaptive chain, an int8 draft's chain, and the n-gram tree alone; their
runs take turns (benchlib.time_interleaved) so that a machine slowing down hurts them alike.
Per configuration: tokens/s over all prompts (best of --repeats each), speedup over our plain decode,
acceptance figures, and for draft-model chains Leviathan et al.'s predicted speedup
(1 - a^(K+1)) / ((1 - a)(Kc + 1)), with a the per-token acceptance solved from the measured tokens per
target forward and c the measured draft/target cost of one forward (their plain decode times), and the
implementation efficiency = measured speedup / predicted speedup.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT
import compilation  # noqa: E402
import decode  # noqa: E402
import generation  # noqa: E402
from tokenizer import get_tokenizer


def load_prompts(pair: Path, tokenizer, count: int, prompt_tokens: int, copy_tokens: int):
    files = [Path(p) for p in (pair / "heldout_files.txt").read_text().split()]
    files = [f for f in files if f.is_file() and len(f.read_text()) > 4000][:count]
    if len(files) < count:
        sys.exit(f"error: fewer than {count} held-out files of > 4000 characters listed in {pair}/heldout_files.txt")
    code, copy = [], []
    for f in files:
        lines = f.read_text().splitlines(keepends=True)
        text = ""
        for line in lines:  # whole lines, up to prompt_tokens
            if len(tokenizer.encode(text + line)) > prompt_tokens:
                break
            text += line
        code.append(tokenizer.encode_prompt(text))  # the tokenizer's own BOS, if it adds one
        body = ""
        for line in lines:
            if len(tokenizer.encode(body + line)) > copy_tokens:
                break
            body += line
        head = "".join(body.splitlines(keepends=True)[:2])
        copy.append(tokenizer.encode_prompt(body + "\n\n" + head))
    return files, code, copy


def leviathan(tokens_per_forward: float, k: int, c: float):
    """Solve E = (1 - a^(K+1)) / (1 - a) for the acceptance a; predicted speedup E / (Kc + 1)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        expected = (k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)
        lo, hi = (a, hi) if expected < tokens_per_forward else (lo, a)
    return a, tokens_per_forward / (k * c + 1)


def merge_stats(runs) -> dict:
    stats = [s for _, s in runs]
    if not stats or "accept_counts" not in stats[0]:
        return {}
    counts = [sum(c) for c in zip(*(s["accept_counts"] for s in stats))]
    steps = sum(counts)  # speculative steps (`auto` may also take plain steps, one token per forward)
    plain = sum(s.get("plain_steps", 0) for s in stats)
    accepted = sum(i * c for i, c in enumerate(counts))
    return {"accept_counts": counts, "mean_accepted": accepted / steps if steps else 0.0, "plain_steps": plain,
            "tokens_per_target_forward": (accepted + steps + plain) / max(steps + plain, 1),
            "acceptance_rate": sum(s["acceptance_rate"] for s in stats) / len(stats),
            "target_forwards": sum(s["target_forwards"] for s in stats),
            "draft_forwards": sum(s["draft_forwards"] for s in stats),
            "speculate_k": stats[0]["speculate_k"], "tree_nodes": stats[0]["tree_nodes"]}


def speculator_for(draft_engine, k, nodes=None, ngram=0):
    """The speculator drafting with draft_engine (None: n-gram lookups alone, or plain decoding)."""
    return generation.make_speculator(generation.Speculation(k, nodes, ngram), draft_engine, max_seq_length=4096)


# chat questions the head never trained on (scripts/chat_requests.py keeps their topics out of its lists)
HELD_OUT = ["What causes the seasons on Earth? Answer in a short paragraph.",
            "Give me three tips for writing clear emails.",
            "How does a refrigerator keep food cold?",
            "Write a short story about a robot who learns to paint.",
            "What is the difference between weather and climate?",
            "Explain how a bill becomes a law, briefly."]
COPY_TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
             "members agreed to spend more on children's books, to extend the opening hours on weekends, and to "
             "hire two more librarians before the end of the year.")


def head_forward_costs(head, rows: list, turns: int = 30, calls: int = 20):
    """One head forward of 1 and 3 tokens (a chain's depth; a catch-up) eager against its compiled body (stored
    graphs with --compile), taking turns, best of `turns` turns of `calls` calls each."""
    head.setup_caches(1, 512)
    compiled, dim = head.compiled, head.args.dim
    configs = {}
    for tokens in (1, 3):
        positions = torch.arange(tokens).view(1, -1) + 100
        args = (torch.randn(1, tokens, dim), torch.randint(0, 1000, (1, tokens)), positions)
        for name, body in (("eager", None), ("compiled", compiled)):
            configs[(name, tokens)] = (body, args)
    best = dict.fromkeys(configs, float("inf"))
    with torch.no_grad():
        for turn in range(turns + 1):  # turn 0 warms up (loads or builds the graph)
            for key, (body, args) in configs.items():
                head.compiled = body
                t = time.perf_counter()
                for _ in range(calls):
                    head(*args)
                if turn:
                    best[key] = min(best[key], (time.perf_counter() - t) / calls)
    head.compiled = compiled
    for (name, tokens), seconds in best.items():
        rows.append({"task": "head forward", "config": f"{name}, {tokens} tokens", "impl": "ours",
                     "ms": 1000 * seconds, "speedup": best[("eager", tokens)] / seconds})
        print(f"  head forward {name}, {tokens} tokens: {1000 * seconds:.3f} ms", flush=True)


def real_model(args):
    """SmolLM2-style rows: every configuration takes turns run by run (best of --repeats after a warm-up), greedy
    and sampled; tokens per target forward; predicted speedup = tokens per target forward * plain step seconds /
    (draft seconds per step + verify seconds at the step's width), from the costs measured in this run; efficiency =
    measured / predicted speedup."""
    bench = RealModel(args)
    cells = set(args.cells.split(","))
    bench.run_cells(cells)
    if "head_cost" in cells and bench.head.compiled is not None:
        head_forward_costs(bench.head, bench.rows)
    bench.price()
    if "chat" in cells:
        llama_cpp_rows(args.gguf, bench.questions, args.new_tokens, args.threads or os.cpu_count(), bench.rows)
    columns = ["task", "temperature", "batch", "impl", "config", "tokens_per_sec", "ms", "speedup",
               "tokens_per_target_forward", "mean_accepted", "plain_steps", "draft_ms_per_step", "predicted_speedup",
               "efficiency", "same_as_plain"]
    print()
    benchlib.print_table(bench.rows, columns)
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "command": sys.argv, "rows": bench.rows,
                                    "head": json.loads((Path(bench.head_dir) / "config.json").read_text()),
                                    "settings": {k: str(v) for k, v in vars(args).items()}})


class RealModel:
    """A real model, its draft head and its own int4 / int4-a8 copies as drafts, loaded and compiled once; the
    rows of every cell measured on them."""

    def __init__(self, args):
        from drafthead import load_head
        self.args, self.rows = args, []
        directory = args.checkpoint_dir
        model_pth, self.head_dir = directory / "model.pth", args.draft_head or directory / "head"
        tokenizer = get_tokenizer(directory)
        self.questions = [tokenizer.chat_ids([{"role": "user", "content": q}]) for q in HELD_OUT[:args.prompts]]
        self.copy = [tokenizer.chat_ids([{"role": "user", "content": f"Repeat this text exactly:\n\n{COPY_TEXT}"}])]
        mode = "none" if args.no_compile else ("autotune" if args.autotune else "auto")
        self.target = target = generation.load_model(model_pth)
        self.eos = sorted(set(target.args.eos_token_ids) | set(tokenizer.eos_ids))  # --stop_at_eos: answers end there
        self.head = compilation.compile_head(load_head(self.head_dir, target), "cpu", mode)
        self.plain_engine = decode.compile_engine(target, "cpu", mode)
        self.head_engine = decode.compile_engine(target, "cpu", mode, features=self.head.args.target_layers)
        self.drafts = {scheme: decode.compile_engine(generation.load_model(benchlib.quantized_checkpoint(
            model_pth, scheme, 32)), "cpu", mode) for scheme in ("int4", "int4-a8")}  # the model's own files

    def spec(self, k, nodes=None, ngram=0, drafter="head"):
        draft = self.drafts.get(drafter)
        return generation.make_speculator(generation.Speculation(k, nodes, ngram), draft, self.target.args.block_size,
                                          self.head if drafter == "head" else None)

    def run_cells(self, cells: set):
        """The chat questions at each temperature, the copy task and a batch of 4, as `cells` asks."""
        args, spec, plain_engine, head_engine = self.args, self.spec, self.plain_engine, self.head_engine
        chains = {f"head chain K={k}": (head_engine, spec(k)) for k in args.head_depths}
        trees = {f"head tree N={n} K={k}": (head_engine, spec(k, n)) for k, n in args.head_trees}
        for temperature in [float(t) for t in args.temperatures.split(",")] if "chat" in cells else []:
            sampling = decode.Sampling(temperature)
            self.measure("chat", sampling, self.questions, {
                "plain": (plain_engine, None), "int4 draft chain K=5": (plain_engine, spec(5, drafter="int4")),
                "int4-a8 draft chain K=5": (plain_engine, spec(5, drafter="int4-a8")),
                "3-gram tree N=16 K=8": (plain_engine, spec(8, 16, 3, drafter=None)), **chains, **trees,
                "head auto": (head_engine, spec("auto", "auto"))})
        if "copy" in cells:
            self.measure("copy", decode.Sampling(0.0), self.copy, {
                "plain": (plain_engine, None), "3-gram tree N=16 K=8": (plain_engine, spec(8, 16, 3, drafter=None)),
                "3-gram auto": (plain_engine, spec("auto", "auto", 3, drafter=None)),
                "head chain K=5": (head_engine, spec(5)), "head auto": (head_engine, spec("auto", "auto"))})
        if "batch" in cells:
            self.measure("chat", decode.Sampling(0.0), self.questions[:4], {
                "plain": (plain_engine, None), "head chain K=5": (head_engine, spec(5)),
                "head tree N=16 K=5": (head_engine, spec(5, 16)), "head auto": (head_engine, spec("auto", "auto"))},
                batch=4)

    def measure(self, task, sampling, prompts, configs, batch=1):
        """configs: name -> (engine, speculator or None); timed in turns, a row each (the first is the baseline)."""
        draft_seconds, steps = dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0)
        timing = [False]  # the warm-up turn's drafts (a graph loaded or built at the first) are not counted
        for name, (_, speculator) in configs.items():  # time each drafter's draft() in the timed runs
            if speculator is not None:
                time_drafts(speculator.drafter, name, timing, draft_seconds, steps)
        best, last = self.time_turns(sampling, prompts, configs, batch, timing)
        base = None
        for name in configs:
            timed_runs = [i for i in range(len(prompts)) if best[name][i] < float("inf")]
            tokens = sum(sum(len(r) for r in last[name][i][0]) for i in timed_runs)
            tps = tokens / sum(best[name][i] for i in timed_runs)
            base = base or tps
            stats = [last[name][i][1] for i in timed_runs]
            row = {"task": task, "temperature": sampling.temperature, "batch": batch, "impl": "ours", "config": name,
                   "tokens_per_sec": tps, "speedup": tps / base}
            if stats and "accept_counts" in stats[0]:
                row.update(merge_stats([(None, s) for s in stats]))
                row["plain_steps"] = sum(s.get("plain_steps", 0) for s in stats)
                if steps[name]:
                    row["draft_ms_per_step"] = 1000 * draft_seconds[name] / steps[name]
            if sampling.temperature == 0:
                row["same_as_plain"] = all(last[name][i][0] == last["plain"][i][0] for i in timed_runs)
            self.rows.append(row)
            print(f"  {task} T={sampling.temperature} B={batch} {name}: {tps:.1f} tok/s x{row['speedup']:.2f}"
                  + (f", {row['tokens_per_target_forward']:.2f} tokens/target forward"
                     if "tokens_per_target_forward" in row else ""), flush=True)

    def time_turns(self, sampling, prompts, configs, batch, timing):
        """Each prompt (batch > 1: each batch of prompts) run by every configuration in turn, a warm-up turn then
        --repeats timed ones. Returns (best seconds per name and prompt, the last (tokens, stats) per name and
        prompt)."""
        args = self.args
        best, last = {name: [float("inf")] * len(prompts) for name in configs}, {}
        for i, ids in enumerate(prompts):
            rows_in = [ids] * batch if batch == 1 else prompts[i:i + batch]
            if batch > 1 and len(rows_in) < batch:
                break
            for turn in range(args.repeats + 1):
                timing[0] = turn > 0
                for name, (engine, speculator) in configs.items():
                    torch.manual_seed(turn)
                    if speculator is not None:  # no copying the last turn's answer to the same prompt
                        speculator.forget()
                    t = time.perf_counter()
                    out, stats = generation.generate(engine, rows_in if batch > 1 else torch.tensor(ids),
                                                     args.new_tokens, sampling, self.eos,
                                                     stop_at_eos=args.stop_at_eos, speculator=speculator)
                    if turn:
                        best[name][i] = min(best[name][i], time.perf_counter() - t)
                    last.setdefault(name, {})[i] = (out, stats)
        return best, last

    def verify_seconds(self, width, batch=1, head_rows=False):
        """One target forward of `width` tokens per row (the best of 5): plain decoding's step for width 1, else a
        verification as the loop runs it (slots and a tree mask; the features a head reads for head rows)."""
        from speculate import synchronize, tree_mask
        target = self.target
        target.setup_caches(batch, 512)
        x = torch.zeros(batch, width, dtype=torch.long)
        pos = torch.arange(100, 100 + width).expand(batch, width)
        mask = torch.cat([tree_mask(list(range(-1, width - 1)), 100, target.max_seq_length, "cpu")] * batch)
        times = []
        for _ in range(6):
            t = time.perf_counter()
            with decode.sdpa_context():
                if width == 1:
                    self.plain_engine.forward(x, pos)
                elif head_rows:
                    self.head_engine.forward_features(x, pos, pos, mask)
                else:
                    self.plain_engine.forward(x, pos, pos, mask)
            synchronize(target)
            times.append(time.perf_counter() - t)
        return min(times[1:])

    def price(self):
        """Predicted speedup and efficiency of the rows whose draft seconds were timed (`auto` rows aside)."""
        # the batches the efficiency column needs only (timing a batch no cell ran would build its graph first)
        rows = [row for row in self.rows if "draft_ms_per_step" in row and "auto" not in row["config"]]
        plain_step = {batch: self.verify_seconds(1, batch) for batch in sorted({row["batch"] for row in rows})}
        for row in rows:
            cost = row["draft_ms_per_step"] / 1000 + self.verify_seconds(row["tree_nodes"] + 1, row["batch"],
                                                                         row["config"].startswith("head"))
            row["predicted_speedup"] = row["tokens_per_target_forward"] * plain_step[row["batch"]] / cost
            row["efficiency"] = row["speedup"] / row["predicted_speedup"]


def time_drafts(drafter, name: str, timing: list, seconds: dict, steps: dict):
    """drafter.draft() wrapped to add its seconds and calls to seconds[name] and steps[name] while timing[0]."""
    real = drafter.draft

    def timed(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        if timing[0]:
            seconds[name] += time.perf_counter() - t
            steps[name] += 1
        return out
    drafter.draft = timed


def llama_cpp_rows(gguf: Path, questions: list, new_tokens: int, threads: int, rows: list):
    """llama.cpp's plain decode of the GGUF and of its Q8_0 copy on the chat questions (second run of each timed);
    none where llama-cpp-python is not installed."""
    import bench_real
    try:
        for path in (gguf, benchlib.requantized_q8_0(gguf)):
            run, _ = bench_real.llama_cpp_run(path, threads)
            seconds = []
            for ids in questions:
                run(ids, new_tokens)
                t = time.perf_counter()
                run(ids, new_tokens)
                seconds.append(time.perf_counter() - t)
            tps = len(questions) * new_tokens / sum(seconds)
            rows.append({"task": "chat", "temperature": 0.0, "batch": 1, "impl": "llama.cpp",
                         "config": f"plain {path.name.split('.')[-2]}", "tokens_per_sec": tps})
            print(f"  llama.cpp {path.name}: {tps:.1f} tok/s", flush=True)
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp rows", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint_dir", type=Path, default=None, help="a real model (see above) instead of the pair")
    p.add_argument("--draft_head", type=Path, default=None, help="the head's directory (default CHECKPOINT_DIR/head)")
    p.add_argument("--gguf", type=Path, default=ROOT / "checkpoints/gguf/SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--head_depths", type=lambda v: [int(x) for x in v.split(",")], default=[3, 4, 5, 6])
    p.add_argument("--head_trees", type=lambda v: [tuple(map(int, x.split("/"))) for x in v.split(",")],
                   default=[(4, 8), (5, 16), (6, 24)], help="K/N pairs, comma-separated")
    p.add_argument("--pair", type=Path, default=ROOT / "checkpoints/tiny", help="train_tiny.py's OUT directory")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt_tokens", type=int, default=96)
    p.add_argument("--copy_tokens", type=int, default=320, help="file tokens in a copy-task prompt")
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--stop_at_eos", action="store_true",
                   help="real model: each answer ends at its end of turn, as a user sees it (default: exactly "
                        "--new_tokens tokens)")
    p.add_argument("--k", type=int, default=5, help="draft depth for chain and tree")
    p.add_argument("--chain_depths", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="the pair's chains at these depths too (the fixed choices `auto` is measured against)")
    p.add_argument("--tree_nodes", default="16", help="the tree's N; comma-separated for several trees (the first "
                                                           "also sizes the merged and n-gram trees)")
    p.add_argument("--ngram", type=int, default=3)
    p.add_argument("--ngram_k", type=int, default=8)
    p.add_argument("--ngram_nodes", type=int, default=16)
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--precision", choices=list(decode.PRECISIONS), default="fp32", help="of target and draft")
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--autotune", action="store_true",
                   help="compile as generate.py --compile autotune does (whole graphs, autotuned GEMM kernels)")
    p.add_argument("--no_transformers", action="store_true")
    p.add_argument("--only", default="", help="comma-separated names of our configurations to run (default: all)")
    p.add_argument("--no_copy", action="store_true", help="skip the copy task")
    p.add_argument("--cells", default="chat,copy,batch,head_cost",
                   help="--checkpoint_dir: which tables to run (chat questions, the copy task, a batch of 4, one "
                        "head forward eager against compiled)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/speculative.json")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    benchlib.check_counts(args, "prompts", "prompt_tokens", "copy_tokens", "new_tokens", "k", "repeats", "threads")
    torch.set_num_threads(args.threads or os.cpu_count())
    torch._dynamo.config.cache_size_limit = 64
    if args.checkpoint_dir is not None:
        if args.json == ROOT / "bench_results/speculative.json":
            args.json = ROOT / "bench_results/speculative_real.json"
        return real_model(args)
    return tiny_pair(args)


def tiny_pair(args):
    """The pair's configurations on code prompts at each temperature (transformers plain and assisted beside them)
    and on the copy task, against our plain decode."""
    bench = Pair(args)
    code_configs, copy_configs = bench.configs()
    benchlib.pick({**code_configs, **copy_configs}, args.only)  # a name matching none: refused before any timing
    plain_tps, draft_tps = bench.plain_speeds()
    hf_target = hf_draft = None
    if not args.no_transformers:
        hf_target, hf_draft = (benchlib.hf_model(args.pair / name, dtype=bench.precision)
                               for name in ("target", "draft"))
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        base_tps = bench.measure("code", temperature, bench.code_prompts, code_configs)
        if hf_target is not None:
            bench.transformers_rows(temperature, base_tps, hf_target, hf_draft)
    if copy_configs:
        bench.measure("copy", 0.0, bench.copy_prompts, copy_configs)
    columns = ["task", "temperature", "impl", "config", "tokens_per_sec", "speedup", "tokens_per_target_forward",
               "mean_accepted", "acceptance_rate", "alpha", "c", "predicted_speedup", "efficiency", "same_as_plain"]
    print()
    benchlib.print_table(bench.rows, columns)
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "command": sys.argv, "c": bench.cost,
                                    "plain_target_tps": plain_tps, "plain_draft_tps": draft_tps,
                                    "prompt_files": [str(f) for f in bench.files],
                                    "settings": {k: str(v) for k, v in vars(args).items()}, "rows": bench.rows})


class Pair:
    """train_tiny.py's target and draft (and an int8 copy of the draft), their prompts, compiled once; the rows of
    every table measured on them."""

    def __init__(self, args):
        self.args, self.rows = args, []
        target_pth, draft_pth = args.pair / "target/model.pth", args.pair / "draft/model.pth"
        for path in (target_pth, draft_pth):
            if not path.is_file():
                sys.exit(f"error: {path} not found: train the pair with python scripts/train_tiny.py --out_dir "
                         f"{args.pair}")
        self.precision = precision = decode.PRECISIONS[args.precision]
        target = generation.load_model(target_pth, precision=precision)
        self.draft = generation.load_model(draft_pth, precision=precision)
        tokenizer = get_tokenizer(args.pair / "target")
        self.files, self.code_prompts, self.copy_prompts = load_prompts(args.pair, tokenizer, args.prompts,
                                                                        args.prompt_tokens, args.copy_tokens)
        print(f"prompts from {', '.join(f.name for f in self.files)}", flush=True)
        # of the target and every draft
        self.mode = ("autotune" if args.autotune else "auto") if not args.no_compile else "none"
        self.engine = decode.compile_engine(target, "cpu", self.mode)
        self.draft_engine = decode.compile_engine(self.draft, "cpu", self.mode)
        self.int8_draft = generation.load_model(benchlib.quantized_checkpoint(draft_pth, "int8"), precision=precision)
        self.draft_engines = {self.draft: self.draft_engine, None: None}  # draft model -> its engine, on first use

    def configs(self) -> tuple:
        """The code prompts' configurations and the copy task's: name -> (draft model or None, K, tree nodes or
        None, n-gram n or 0)."""
        args, draft = self.args, self.draft
        sizes = [int(v) for v in args.tree_nodes.split(",")]
        k, nodes, n = args.k, sizes[0], args.ngram
        code = {**{f"chain K={depth}": (draft, depth, None, 0) for depth in sorted({k, *args.chain_depths})},
                **{f"tree N={size} K={k}": (draft, k, size, 0) for size in sizes},
                f"tree N={nodes} K={k} + {n}-gram lookups": (draft, k, nodes, n),
                "chain K=auto": (draft, "auto", None, 0), f"chain K={k}, int8 draft": (self.int8_draft, k, None, 0),
                f"{n}-gram tree N={nodes} K={k} (no draft)": (None, k, nodes, n)}
        copy = {} if args.no_copy else {  # draft-free n-gram drafting (and the draft model's, for reference)
            f"{n}-gram tree N={args.ngram_nodes} K={args.ngram_k}": (None, args.ngram_k, args.ngram_nodes, n),
            f"{n}-gram chain K={args.ngram_k}": (None, args.ngram_k, None, n),
            f"chain K={k}": (draft, k, None, 0),
            f"tree N={nodes} K={k} + {n}-gram lookups": (draft, k, nodes, n)}
        return code, copy

    def plain_speeds(self) -> tuple:
        """Target's and draft's plain decode on the code prompts (tokens/s); sets `cost`, c: one draft forward / one
        target forward."""
        args, greedy = self.args, decode.Sampling(0.0)
        speeds = benchlib.time_interleaved(self.engine, {"target": None}, self.code_prompts, args.new_tokens, greedy,
                                           args.repeats)
        speeds.update(benchlib.time_interleaved(self.draft_engine, {"draft": None}, self.code_prompts,
                                                args.new_tokens, greedy, args.repeats))
        plain_tps, draft_tps = speeds["target"][0], speeds["draft"][0]
        self.cost = plain_tps / draft_tps
        print(f"plain decode: target {plain_tps:.1f} tok/s, draft {draft_tps:.1f} tok/s (c = {self.cost:.3f})",
              flush=True)
        return plain_tps, draft_tps

    def measure(self, task, temperature, prompts, configs):
        """configs: name -> (draft model or None, K, tree nodes or None, n-gram n or 0); plus plain decoding.
        Returns plain decoding's tokens/s."""
        args, sampling = self.args, decode.Sampling(temperature)
        if args.only:
            configs = {name: c for name, c in configs.items() if name in args.only.split(",")}
        speculators = {"plain": None}
        for name, (model, k, nodes, ngram) in configs.items():
            if model not in self.draft_engines:
                self.draft_engines[model] = decode.compile_engine(model, "cpu", self.mode)
            speculators[name] = speculator_for(self.draft_engines[model], k, nodes, ngram)
        results = benchlib.time_interleaved(self.engine, speculators, prompts, args.new_tokens, sampling,
                                            args.repeats)
        base_tps, base_runs = results["plain"]
        self.rows.append({"task": task, "temperature": temperature, "impl": "ours", "config": "plain",
                          "tokens_per_sec": base_tps, "speedup": 1.0})
        for name, (model, k, nodes, ngram) in configs.items():
            tps, runs = results[name]
            row = {"task": task, "temperature": temperature, "impl": "ours", "config": name,
                   "tokens_per_sec": tps, "speedup": tps / base_tps, **merge_stats(runs)}
            if temperature == 0:
                row["same_as_plain"] = all(a == b for (a, _), (b, _) in zip(runs, base_runs))
            if name == f"chain K={k}" and isinstance(k, int) and model is self.draft:
                row["alpha"], row["predicted_speedup"] = leviathan(row["tokens_per_target_forward"], k, self.cost)
                row["c"] = self.cost
                row["efficiency"] = row["speedup"] / row["predicted_speedup"]
            self.rows.append(row)
            print(f"  {task} T={temperature} {name}: {tps:.1f} tok/s, x{row['speedup']:.2f}, "
                  f"{row['tokens_per_target_forward']:.2f} tokens/target forward", flush=True)
        return base_tps

    def transformers_rows(self, temperature, base_tps, hf_target, hf_draft):
        """transformers' generate() on the code prompts, plain and assisted by the draft."""
        args = self.args
        hf_kwargs = {} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_k": 0}
        for name, assistant in (("transformers", None), ("transformers assisted", hf_draft)):
            tps = 0.0
            for prompt in self.code_prompts:
                t, _ = benchlib.time_transformers(hf_target, prompt, args.new_tokens, assistant, args.repeats,
                                                  **hf_kwargs)
                tps += 1 / t
            tps = len(self.code_prompts) / tps
            self.rows.append({"task": "code", "temperature": temperature, "impl": "transformers", "config": name,
                              "tokens_per_sec": tps, "speedup": tps / base_tps})
            print(f"  code T={temperature} {name}: {tps:.1f} tok/s", flush=True)


if __name__ == "__main__":
    sys.exit(run_cli(main))
