"""Decode speed, in one process run: our generation.generate() (eager and compiled: regional, whole graph, autotuned;
fp32, bf16, int8, int4) against transformers' greedy generate() on the same weights, beside the bandwidth
this machine measures. The real model against llama.cpp on its GGUF: scripts/bench_real.py.

    python scripts/bench.py                                   # tiny target + a random TinyLlama-1.1B-shape model
    python scripts/bench.py --skip_large --json bench_results/bench.json

Every row: tokens/s (best of --repeats, prefill of a short prompt included), achieved GB/s (weight bytes
read per token x tokens/s), that as a % of the measured read bandwidth, and the roofline (measured read
bandwidth / weight bytes per token): the most tokens/s a decode that reads each weight once can reach.
Quantized checkpoints are written by quantize.py beside the fp32 ones and loaded through
generation.load_model, exactly as generate.py runs them.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ROOT
import decode  # noqa: E402
import generation  # noqa: E402
from errors import write_atomically
from model import ModelArgs, Transformer

TINY_TARGET = ROOT / "checkpoints/tiny/target/model.pth"  # scripts/train_tiny.py's target, labelled "tiny"

VARIANTS = [  # (precision, quantization); int4 uses --int4_groupsize
    ("fp32", None), ("bf16", None), ("fp32", "int8"), ("fp32", "int4"),
]


def random_large_checkpoint(directory: Path, name: str) -> Path:
    """A random-init model of a known shape (weights N(0, 0.02)), written as model.pth + config.json."""
    path = directory / "model.pth"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    args = ModelArgs.from_name(name)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    state = {k: torch.empty(v.shape).normal_(0, 0.02) for k, v in model.state_dict().items()}
    for k in state:
        if k.endswith("norm.weight"):
            state[k].fill_(1.0)
    config = json.dumps(args.to_hf_config(), indent=2)
    write_atomically(directory / "config.json", lambda tmp: tmp.write_text(config))
    write_atomically(path, lambda tmp: torch.save(state, tmp))
    return path


def bench_model(label: str, model_pth: Path, args, bandwidth: dict, with_transformers: bool) -> list:
    rows = []
    prompt = list(range(3, 3 + args.prompt_tokens))
    greedy = decode.Sampling(0.0)
    read_gbs = bandwidth["read_gbs"]
    reference_ids = None
    for precision, quant in [v for v in VARIANTS if (v[1] or v[0]) in args.variants.split(",")]:
        path = benchlib.quantized_checkpoint(model_pth, quant, args.int4_groupsize) if quant else model_pth
        model = generation.load_model(path, "cpu", decode.PRECISIONS[precision])
        nbytes = model.model_bytes()
        modes = ["eager"] if args.no_compile else args.modes.split(",")
        for mode in modes:
            torch._dynamo.reset()
            t = time.perf_counter()
            engine = decode.compile_engine(model, "cpu", "none" if mode == "eager" else mode)
            tps, tokens, _ = benchlib.time_ours(engine, prompt, args.new_tokens, greedy, repeats=args.repeats)
            row = {"model": label, "impl": "ours", "precision": precision, "quant": quant or "-",
                   "compile": mode, "tokens_per_sec": tps, "gbs": nbytes * tps / 1e9,
                   "pct_read_bw": 100 * nbytes * tps / 1e9 / read_gbs, "roofline_tps": read_gbs * 1e9 / nbytes,
                   "model_mb": nbytes / 1e6, "seconds_total": time.perf_counter() - t}
            if precision == "fp32" and quant is None:
                reference_ids = reference_ids or tokens
                row["same_ids_as_eager_fp32"] = tokens == reference_ids
            rows.append(row)
            print(f"  {label} ours {precision} {quant or ''} {mode}: {tps:.1f} tok/s "
                  f"({row['pct_read_bw']:.0f}% of read bandwidth)", flush=True)
        del model
    if with_transformers:
        for precision in ("fp32", "bf16"):
            hf = benchlib.hf_model(model_pth.parent, decode.PRECISIONS[precision])
            nbytes = sum(p.numel() * p.element_size() for p in hf.parameters())
            tps, ids = benchlib.time_transformers(hf, prompt, args.new_tokens, repeats=args.repeats)
            row = {"model": label, "impl": "transformers", "precision": precision, "quant": "-", "compile": "eager",
                   "tokens_per_sec": tps, "gbs": nbytes * tps / 1e9, "pct_read_bw": 100 * nbytes * tps / 1e9 / read_gbs,
                   "roofline_tps": read_gbs * 1e9 / nbytes, "model_mb": nbytes / 1e6}
            if precision == "fp32":
                row["same_ids_as_eager_fp32"] = ids == reference_ids
            rows.append(row)
            print(f"  {label} transformers {precision}: {tps:.1f} tok/s", flush=True)
            del hf
    hf_fp32 = next((r["tokens_per_sec"] for r in rows if r["impl"] == "transformers" and r["precision"] == "fp32"),
                   None)
    for r in rows:
        if hf_fp32:
            r["x_transformers_fp32"] = r["tokens_per_sec"] / hf_fp32
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny_checkpoint", type=Path, default=TINY_TARGET,
                   help="a model.pth (default: the trained tiny target of scripts/train_tiny.py); rows of any other "
                        "model are labelled by its directory's name")
    p.add_argument("--large_model", default="TinyLlama-1.1B", help="known shape of the random-init large model")
    p.add_argument("--large_dir", type=Path, default=None,
                   help="where to keep the large random checkpoint (default: a temporary directory)")
    p.add_argument("--skip_large", action="store_true")
    p.add_argument("--no_compile", action="store_true")
    p.add_argument("--modes", default="eager,regional,autotune",
                   help="comma-separated: eager, regional (generate.py --compile regional: what --compile picks for "
                        "deep models on the CPU), whole (--compile whole: what it picks for shallow ones), autotune "
                        "(--compile autotune), auto (--compile)")
    p.add_argument("--variants", default="fp32,bf16,int8,int4", help="comma-separated: which of ours to run")
    p.add_argument("--prompt_tokens", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--large_new_tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--int4_groupsize", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: every core)")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results/bench.json")
    args = p.parse_args(argv)
    benchlib.check_counts(args, "prompt_tokens", "new_tokens", "large_new_tokens", "repeats", "threads")
    torch.set_num_threads(args.threads or os.cpu_count())
    if not args.tiny_checkpoint.is_file():
        sys.exit(f"error: {args.tiny_checkpoint} not found: train it with python scripts/train_tiny.py")

    bandwidth = benchlib.measure_bandwidth()
    print(f"measured: read {bandwidth['read_gbs']:.1f} GB/s, fp32 mat-vec {bandwidth['fp32_matvec_gbs']:.1f} GB/s",
          flush=True)
    label = "tiny" if args.tiny_checkpoint.resolve() == TINY_TARGET.resolve() else args.tiny_checkpoint.parent.name
    rows = bench_model(label, args.tiny_checkpoint, args, bandwidth, with_transformers=True)
    if not args.skip_large:
        with tempfile.TemporaryDirectory() as tmp:
            large_dir = args.large_dir or Path(tmp) / args.large_model
            large_pth = random_large_checkpoint(large_dir, args.large_model)
            large_args = argparse.Namespace(**{**vars(args), "new_tokens": args.large_new_tokens, "repeats": 2})
            rows += bench_model(args.large_model, large_pth, large_args, bandwidth, with_transformers=False)
    columns = ["model", "impl", "precision", "quant", "compile", "tokens_per_sec", "gbs", "pct_read_bw",
               "roofline_tps", "x_transformers_fp32", "model_mb"]
    print()
    benchlib.print_table(rows, columns)
    benchlib.write_json(args.json, {"machine": benchlib.machine(), "bandwidth": bandwidth, "command": sys.argv,
                                    "settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows})


if __name__ == "__main__":
    sys.exit(run_cli(main))
