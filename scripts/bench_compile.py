"""Compile time and decode speed of each way decode.compile_engine can compile, in fresh processes.

    python scripts/bench_compile.py                     # tiny target, and SmolLM2-135M when converted
    python scripts/bench_compile.py --threads 1 --json bench_results/compile.json

Each variant runs twice, each time in a new process: "cold" with an empty inductor cache directory
(TORCHINDUCTOR_CACHE_DIR set to a new temporary directory, so nothing compiled before is reused; this also
pays inductor's one-time probe of the CPU's vector instructions), then "warm" with the directory the cold run
filled (FX graph cache and AOTAutograd cache hits). Columns:
  compile s     the first generation.generate() of 8 tokens (eager prefill, then the decode graphs compile)
  verify s      then the first call of engine.forward on 6 tokens with a mask (a chain K=5 verification shape)
  draft s       then compile_engine on the draft model and its first generate() (speculative runs)
  tok/s         best of --repeats greedy generate() runs of --new_tokens tokens after a 16-token prompt
  same          the greedy tokens equal the eager model's
Variants: eager (mode "none"); "whole graph" (compile_engine mode "whole", generate.py --compile whole: one graph,
inductor freezing on CPU); "regional" (mode "regional", what --compile picks on the CPU for models of more than 8
layers: one compiled block for every layer); "autotune" (generate.py --compile autotune: the whole graph with every
matmul shape timed against inductor's C++ GEMM templates); the "row-major" variants keep every weight in its
checkpoint layout (kernels.use_fast_weight_layout skipped), which is how whole-graph compilation ran before regional
compilation and the per-device layout were added.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT  # noqa: E402

VARIANTS = ["eager", "whole graph, row-major", "whole graph", "regional, row-major", "regional", "autotune"]
MODELS = [  # label, target, draft (the draft of scripts/demo.sh for SmolLM2: its own int4 copy)
    ("tiny", ROOT / "checkpoints/tiny/target/model.pth", ROOT / "checkpoints/tiny/draft/model.pth"),
    ("SmolLM2-135M", ROOT / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth",
     ROOT / "checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int4.g32.pth"),
]


def child(variant: str, target: str, draft: str, new_tokens: int, repeats: int) -> dict:
    """One process: load, compile as `variant`, time; returns the row."""
    import decode
    import generation
    import kernels

    if "row-major" in variant:  # generation.load_model calls the name it imported from kernels
        generation.use_fast_weight_layout = kernels.use_fast_weight_layout = lambda model: None
    greedy = decode.Sampling()
    prompt = torch.arange(3, 19)

    mode = {"eager": "none", "whole graph": "whole", "regional": "regional", "autotune": "autotune"}[
        variant.split(",")[0]]

    def make_engine(model):
        return decode.compile_engine(model, "cpu", mode)

    def run(engine, n):
        return generation.generate(engine, prompt, n, greedy, [], stop_at_eos=False)[0][0]

    model = generation.load_model(target)
    reference = run(decode.Engine(model), new_tokens)
    row = {}
    t = time.perf_counter()
    engine = make_engine(model)
    run(engine, 8)
    row["compile_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():  # as generation.generate() runs
        positions = torch.arange(16, 22).view(1, -1)
        mask = torch.arange(model.max_seq_length).view(1, 1, 1, -1) <= positions.view(1, 1, -1, 1)
        engine.forward(torch.arange(40, 46).view(1, -1), positions, positions, mask)
    row["verify_s"] = time.perf_counter() - t
    if draft:
        t = time.perf_counter()
        run(make_engine(generation.load_model(draft)), 8)
        row["draft_s"] = time.perf_counter() - t
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        tokens = run(engine, new_tokens)
        best = max(best, new_tokens / (time.perf_counter() - t))
    row.update(tok_s=best, same=tokens == reference)
    return row


def measure(variant: str, target: Path, draft, cache_dir: str, args) -> dict:
    command = [sys.executable, __file__, "--child", variant, str(target), str(draft or ""),
               "--new_tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    result = subprocess.run(command, cwd=ROOT, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir),
                            capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{variant} on {target} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--only", default=None, help="';'-separated variants to run (default: all)")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/compile.json")
    p.add_argument("--child", nargs=3, metavar=("VARIANT", "TARGET", "DRAFT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    benchlib.check_counts(args, "new_tokens", "repeats", "threads", zero_means_default=())
    torch.set_num_threads(args.threads)
    if args.child:
        variant, target, draft = args.child
        print(json.dumps(child(variant, target, draft or None, args.new_tokens, args.repeats)))
        return
    variants = benchlib.pick(VARIANTS, args.only, ";")
    rows = []
    for label, target, draft in MODELS:
        if not target.is_file():
            print(f"skipping {label}: {target} not found")
            continue
        draft = draft if draft.is_file() else None
        for variant in variants:
            with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
                for cache in ("cold", "warm"):
                    row = {"model": label, "variant": variant, "cache": cache,
                           **measure(variant, target, draft, cache_dir, args)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    columns = ["model", "variant", "cache", "compile_s", "verify_s", "draft_s", "tok_s", "same"]
    benchlib.print_table(rows, columns)
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "threads": args.threads,
                                    "new_tokens": args.new_tokens, "rows": rows})


if __name__ == "__main__":
    sys.exit(run_cli(main))
