"""The integer a8 kernels (kernels_a8.cpp) against the paths they stand beside, in one process, taking turns:
  1. one-row products of SmolLM2-135M's matrix shapes: GB/s of weight bytes moved per call (fp32 F.linear on the
     column-major weight decode uses, weight-only int8 (`fastgen::int8_linear`, "int8 fp32-x" on the a8 layout) /
     int4 g32 on ATen's kernel, int8-a8 / int4-a8 g32), one shape at a time; and one decode step's products, the
     121 distinct matrices in turn (w1 and w3 stacked, as decode runs them), so each starts cold in the cache as in
     decode;
  2. greedy generate() tokens/s on the real model for fp32, int8, int8-a8, int4 g32, int4-a8 g32, eager and with
     regional compilation.

    python scripts/bench_a8.py --json bench_results/a8.json
    python scripts/bench_a8.py --skip_decode          # the products only (no checkpoint needed)
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import UserError, interruptible_imports, run_cli  # noqa: E402
interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import benchlib  # noqa: E402
import decode  # noqa: E402
import generation  # noqa: E402
import kernels  # noqa: E402
import quantize  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]  # SmolLM2-135M's [out, in]
CHECKPOINT = Path("checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth")
DECODE = [("fp32", None, None), ("int8", "int8", None), ("int8-a8", "int8-a8", None), ("int4 g32", "int4", 32),
          ("int4-a8 g32", "int4-a8", 32)]


def weight_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def product_candidates(out_features: int, in_features: int, only: str = None) -> dict:
    """name -> (one-row product, weight bytes it reads); only: just that one (and what it needs)."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) / in_features ** 0.5
    column_major = w.t().contiguous().t()
    out = {"fp32 F.linear": (lambda x: F.linear(x, column_major), w.numel() * 4)} if only is None else {}
    wanted = {"int8 fp32-x": "int8-a8"}.get(only, only)
    for name, cls, args in [("int8", quantize.Int8Linear, ()), ("int8-a8", quantize.Int8A8Linear, ()),
                            ("int4 g32", quantize.Int4Linear, (32,)), ("int4-a8 g32", quantize.Int4A8Linear, (32,))]:
        if wanted is not None and name != wanted:
            continue
        module = cls(in_features, out_features, *args)
        if name.startswith("int8"):
            module.weight, module.scales = quantize.quantize_int8(w)
        else:
            module.weight, module.scales_and_zeros = quantize.quantize_int4(w, 32)
        if hasattr(module, "pack_for_cpu"):
            module.pack_for_cpu()
        out[name] = (module, weight_bytes(module))
    if only in (None, "int8 fp32-x"):  # the same int8 weights times float32 activations (Int8Linear's CPU kernel)
        a8 = out.pop("int8-a8")[0] if only else out["int8-a8"][0]
        out["int8 fp32-x"] = (lambda x: torch.ops.fastgen.int8_linear(x, a8.weight, a8.scales), weight_bytes(a8))
    return out


def bench_products(turns: int, seconds_per_call: float) -> list:
    rows = []
    for out_features, in_features in SHAPES:
        candidates = product_candidates(out_features, in_features)
        x = torch.randn(1, in_features)
        best = dict.fromkeys(candidates, float("inf"))
        calls = {}
        with torch.no_grad():
            for name, (fn, _) in candidates.items():  # warm up, and enough calls per turn for a steady timing
                start = time.perf_counter()
                fn(x)
                calls[name] = max(3, int(seconds_per_call / max(time.perf_counter() - start, 1e-6)))
            for _ in range(turns):  # taking turns: a busy moment of a shared machine slows all alike
                for name, (fn, _) in candidates.items():
                    start = time.perf_counter()
                    for _ in range(calls[name]):
                        fn(x)
                    best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
        row = {"shape": f"{out_features}x{in_features}"}
        for name, (_, nbytes) in candidates.items():
            row[f"{name} GB/s"] = nbytes / best[name] / 1e9
            row[f"{name} us"] = best[name] * 1e6
        rows.append(row)
    return rows


STEP = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # wqkv wo w13 w2, head


def operator_of(module):
    """The operator a stored graph calls for this packed module (without the module's Python and reshapes)."""
    ops = torch.ops.fastgen
    if isinstance(module, quantize.Int4A8Linear):
        return lambda x: ops.a8_int4_linear(x, module.weight, module.scales_and_zeros, module.groupsize)
    if isinstance(module, quantize.Int4Linear):
        sz = module.scales_and_zeros.to(torch.bfloat16)
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, module.weight, module.groupsize, sz)
    if isinstance(module, quantize.Int8A8Linear):
        return lambda x: ops.a8_int8_linear(x, module.weight, module.scales)
    return lambda x: ops.int8_linear(x, module.weight, module.scales)


def bench_step(turns: int) -> list:
    """One decode step's products with distinct weights (SmolLM2's 121 matrices, 0.1-28 MB each, more than the last
    level cache together): each product starts cold, as in decode, unlike a loop over one matrix."""
    inputs = {k: torch.randn(1, k) for k in (576, 1536)}
    rows = []
    for name in ["int8", "int8-a8", "int4 g32", "int4-a8 g32"]:  # (int8: fastgen::int8_linear)
        calls = []
        for n, k in STEP:
            module, nbytes = product_candidates(n, k, only=name)[name]
            calls.append((operator_of(module), inputs[k] if "int4 " not in name else inputs[k].bfloat16(), nbytes))
        nbytes = sum(b for _, _, b in calls)
        best = float("inf")
        with torch.no_grad():
            for turn in range(turns + 1):  # turn 0 warms up
                start = time.perf_counter()
                for fn, x, _ in calls:
                    fn(x)
                if turn:
                    best = min(best, time.perf_counter() - start)
        rows.append({"config": name, "ms per step": best * 1e3, "MB": nbytes / 1e6, "GB/s": nbytes / best / 1e9})
        del calls
    return rows


def bench_decode(checkpoint: Path, modes: list, new_tokens: int, repeats: int) -> list:
    prompt = torch.tensor([1] + list(range(100, 115)))  # 16 tokens
    engines = {}
    for name, mode, groupsize in DECODE:
        path = benchlib.quantized_checkpoint(checkpoint, mode, groupsize) if mode else checkpoint
        for compile_mode in modes:
            engines[(name, compile_mode)] = decode.compile_engine(generation.load_model(path), "cpu", compile_mode)
    best = dict.fromkeys(engines, float("inf"))
    tokens = {}
    for turn in range(repeats + 1):  # turn 0 warms up (and compiles)
        for key, engine in engines.items():
            start = time.perf_counter()
            out, _ = generation.generate(engine, prompt, new_tokens, decode.Sampling(), [], stop_at_eos=False)
            if turn:
                best[key] = min(best[key], time.perf_counter() - start)
            tokens[key] = out[0]
    rows = []
    for compile_mode in modes:
        fp32 = new_tokens / best[("fp32", compile_mode)]
        for name, _, _ in DECODE:
            tps = new_tokens / best[(name, compile_mode)]
            rows.append({"config": name, "compile": compile_mode, "tokens/s": tps, "x fp32": tps / fp32,
                         "MB": engines[(name, compile_mode)].model.model_bytes() / 1e6,
                         "same tokens as fp32": tokens[(name, compile_mode)] == tokens[("fp32", compile_mode)]})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint_path", type=Path, default=CHECKPOINT, help="the fp32 SmolLM2-135M model.pth")
    p.add_argument("--turns", type=int, default=15, help="turns of the product timings (best of)")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed turns of each decode configuration (best of)")
    p.add_argument("--compile", nargs="+", default=["none", "regional"], help="compile modes of the decode runs")
    p.add_argument("--skip_decode", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    benchlib.check_counts(args, "turns", "new_tokens", "repeats", "threads")
    if not args.skip_decode and not Path(args.checkpoint_path).is_file():  # before the products' timings
        raise UserError(f"checkpoint not found: {args.checkpoint_path} (pass the fp32 model.pth, or --skip_decode)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not kernels.a8_kernels():
        sys.exit("kernels_a8.cpp does not build here: nothing to compare")
    info = dict(benchlib.machine(), a8_isa=torch.ops.fastgen.a8_isa())
    print(info)
    products = bench_products(args.turns, 2e-3)
    names = ["fp32 F.linear", "int8", "int8-a8", "int8 fp32-x", "int4 g32", "int4-a8 g32"]
    print("\none-row products, GB/s of weights moved")
    benchlib.print_table(products, ["shape"] + [f"{n} GB/s" for n in names])
    result = {"machine": info, "products": products, "step": bench_step(max(3, args.turns // 3))}
    print("\none decode step's products (121 distinct matrices, cold in the cache)")
    benchlib.print_table(result["step"], ["config", "ms per step", "MB", "GB/s"])
    if not args.skip_decode:
        result["decode"] = bench_decode(args.checkpoint_path, args.compile, args.new_tokens, args.repeats)
        print(f"\ngenerate(), {args.new_tokens} new tokens after 16, greedy")
        benchlib.print_table(result["decode"], ["config", "compile", "tokens/s", "x fp32", "MB", "same tokens as fp32"])
    if args.json:
        benchlib.write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(run_cli(main))
