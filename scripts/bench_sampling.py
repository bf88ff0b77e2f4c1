"""The cost of drawing one token from a row of logits (warping and sampling, decode.sample) at real vocabulary sizes,
against the textbook formulation it replaced, eager and compiled, in one process.

    python scripts/bench_sampling.py
    python scripts/bench_sampling.py --vocab_sizes 49152 --json bench_results/sampling_smollm2.json

The textbook formulation (what decode.py did before, and what gpt-fast does): exponential noise from
Tensor.exponential_() for the race argmax(p / E), and top-p by sorting the whole vocabulary even after top-k.
Ours: top-p over the k values top-k already ranked, and one draw by inverse CDF (decode.sample_from); "race" is
our warping with the exponential race of before (E = -log U, decode.exponential_like). Same distributions
(tests/test_generate.py, and every lossless test); this measures only time per call (best of --repeats batches).
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
import decode  # noqa: E402


def textbook_sample(logits: torch.Tensor, sampling: decode.Sampling) -> torch.Tensor:
    """Temperature, top-k by masking below the k-th logit, top-p by a sort of the whole row, exponential_ race."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        mass = sorted_logits.softmax(-1)
        drop = mass.cumsum(-1) - mass >= sampling.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def race_sample(logits: torch.Tensor, sampling: decode.Sampling) -> torch.Tensor:
    """Our warping, then the exponential race argmax(p / E) with E = -log U (what decode.sample_from did before it
    drew by inverse CDF): V uniforms per row instead of one."""
    probs = decode.logits_to_probs(logits, sampling)
    return torch.argmax(probs / decode.exponential_like(probs), dim=-1)


def ms_per_call(fn, logits, sampling, calls: int, repeats: int) -> float:
    for _ in range(3):
        fn(logits, sampling)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(logits, sampling)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def vocab_sizes(text: str) -> list:
    """--vocab_sizes: comma-separated integers >= 2 (argparse turns the ValueError into its one usage line)."""
    sizes = [int(v) for v in text.split(",")]
    if min(sizes) < 2:
        raise ValueError(text)
    return sizes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab_sizes", type=vocab_sizes, default="4096,49152,128256", help="the tiny pair, SmolLM2, Llama 3")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/sampling.json")
    args = p.parse_args(argv)
    benchlib.check_counts(args, "calls", "repeats", "threads")
    torch.set_num_threads(args.threads or os.cpu_count())
    settings = {"T=0.7": decode.Sampling(0.7), "T=0.7 top-k 200": decode.Sampling(0.7, top_k=200),
                "T=0.7 top-k 200 top-p 0.9": decode.Sampling(0.7, top_k=200, top_p=0.9),
                "T=0.7 top-p 0.9": decode.Sampling(0.7, top_p=0.9)}
    samplers = {"textbook": textbook_sample, "race": race_sample,
                "ours": lambda logits, sampling: decode.sample(logits, sampling)[0]}
    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in samplers.items()}
    rows = []
    for vocab in args.vocab_sizes:
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 3  # [1, V]
        for label, sampling in settings.items():
            row = {"vocab": vocab, "sampling": label}
            for mode, fns in (("eager", samplers), ("compiled", compiled)):
                for name, fn in fns.items():
                    row[f"{name} {mode} ms"] = ms_per_call(fn, logits, sampling, args.calls, args.repeats)
                row[f"{mode} x"] = row[f"textbook {mode} ms"] / row[f"ours {mode} ms"]
                row[f"{mode} x race"] = row[f"race {mode} ms"] / row[f"ours {mode} ms"]
            rows.append(row)
            print(", ".join(f"{k} {benchlib.fmt(v)}" for k, v in row.items()), flush=True)
    print()
    benchlib.print_table(rows, list(rows[0]))
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "command": sys.argv, "rows": rows})


if __name__ == "__main__":
    sys.exit(run_cli(main))
