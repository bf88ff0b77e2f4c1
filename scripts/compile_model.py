"""Build and store every compiled graph a configuration needs, so that later runs start at full speed; list or prune
what compiled/ holds.

    python scripts/compile_model.py --checkpoint_path checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model.pth \
        --draft_checkpoint_path checkpoints/HuggingFaceTB/SmolLM2-135M-Instruct/model_int4.g32.pth --speculate_k 5
    python scripts/compile_model.py --checkpoint_path .../model.pth --draft_head .../head   # the head's graphs too
    python scripts/compile_model.py --checkpoint_path .../model.pth --batch_size 1 4 8      # a server's batches
    python scripts/compile_model.py --checkpoint_path .../model.pth --list    # what compiled/ holds, what is stale
    python scripts/compile_model.py --checkpoint_path .../model.pth --prune   # remove the stale

On CUDA (and for `--compile whole` / `regional`) the graphs compile in the process and what is stored is their
kernels (compilation.CompileCache), so later processes skip code generation, builds and autotuning.
A stored graph serves one batch size, every cache length and every token count per call, so decode, verification
and prefill share it. Graphs already stored and valid are loaded, not rebuilt. Prints what was built, its time and
size. Stale artifacts (built for a weights file that changed, other software, another machine or older code, and
failed builds' markers) are never loaded; --prune removes them, and removing compiled/ removes everything.
--list and --prune cover the kernels this machine keeps for other weights files of the same shape too (in the user's
cache: a new weights file of a shape built before takes a copy of them, not a build).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from errors import UserError, interruptible_imports, run_cli  # noqa: E402

interruptible_imports(__name__)  # Ctrl-C while torch loads: one line, exit 130
from generation import Generator, Sampling, Speculation, check_engine_settings  # noqa: E402


def compile_model(checkpoint_path, draft_checkpoint_path=None, speculation=None, batch_sizes=(1,), mode="auto",
                  device="cpu", precision=None, draft_head=None):
    """Build (or load) the graphs of each batch size; returns one row per model and batch size: the model, the stem
    of its artifacts' names, the batch and the seconds this run spent on it."""
    from decode import PRECISIONS
    dtype = PRECISIONS[precision or ("bf16" if device.startswith("cuda") else "fp32")]
    rows = []
    for batch in sorted(set(batch_sizes)):
        start = time.perf_counter()
        generator = Generator.build(checkpoint_path, device, dtype, draft_checkpoint_path, speculation, mode,
                                    batch_size=batch, draft_head=draft_head)
        if not generator.target.mode.startswith("stored") and generator.target.cache is None:
            raise UserError(f"`compile` {mode} stores nothing here ({generator.target.mode}): use auto or autotune")
        drafter = getattr(generator.speculator, "drafter", None)
        models = [(generator.model, Path(generator.model.checkpoint_path).stem),
                  (getattr(drafter, "draft_model", None), None), (getattr(drafter, "head", None), "head")]
        # a few tokens: every graph the configuration runs is called (speculative runs verify a few trees); caches
        # checked against memory first (a batch beyond it was killed by the kernel, with no word, after the build)
        prompt, steps = [1] * 4, 8
        generator.reserve(batch, len(prompt) + steps, fix="lower `batch_size`")
        generator.generate(prompt, steps, Sampling(0.0), stop_at_eos=False, batch_size=batch)
        rows += [{"model": str(model.checkpoint_path), "stem": stem or Path(model.checkpoint_path).stem,
                  "batch": batch, "seconds": round(time.perf_counter() - start, 1)}
                 for model, stem in models if model is not None]
    return rows


def directories(checkpoint_path, draft_checkpoint_path=None, draft_head=None) -> dict:
    """The compiled/ directories of a configuration's models, each once, with the directory of their weights."""
    import artifacts
    head = draft_head and (Path(draft_head) if Path(draft_head).is_file() else Path(draft_head) / "model.safetensors")
    paths = [checkpoint_path, draft_checkpoint_path, head]
    return {artifacts.directory_for(p): Path(p).parent for p in paths if p is not None}


def show(rows: list):
    print(f"{'artifact':64s} {'kind':13s} {'MB':>8s}  stale")
    for row in rows:
        print(f"{row['name'][:64]:64s} {row['kind']:13s} {row['bytes'] / 1e6:8.1f}  {row['stale'] or '-'}")
    stale = sum(row["bytes"] for row in rows if row["stale"])
    print(f"{len(rows)} artifacts, {sum(row['bytes'] for row in rows) / 1e6:.1f} MB ({stale / 1e6:.1f} MB stale)")


def prune(rows: list) -> int:
    """Remove the stale artifacts' files; returns the bytes freed."""
    freed = 0
    for row in rows:
        if row["stale"]:
            for path in row["paths"]:
                Path(path).unlink(missing_ok=True)
            freed += row["bytes"]
    return freed


def main():
    args = parse_args()
    check_engine_settings(args.compile, args.precision, args.device)
    if args.list or args.prune:
        if not args.checkpoint_path.is_file():
            raise UserError(f"checkpoint not found: {args.checkpoint_path}")
        import artifacts
        from compilation import inventory
        found = directories(args.checkpoint_path, args.draft_checkpoint_path, args.draft_head)
        for directory, weights in {**found, artifacts.kept_directory(): None}.items():
            rows = inventory(directory, weights)
            print(f"{directory}:")
            show(rows)
            if args.prune:
                print(f"removed {prune(rows) / 1e6:.1f} MB of stale artifacts")
        return
    if min(args.batch_size) < 1:
        raise UserError("`batch_size` must be >= 1")
    start = time.perf_counter()
    speculation = Speculation(args.speculate_k, args.tree_nodes, args.draft_ngram)
    rows = compile_model(args.checkpoint_path, args.draft_checkpoint_path, speculation, args.batch_size,
                         args.compile, args.device, args.precision, args.draft_head)
    report(rows)
    print(f"stored in {next(iter(directories(args.checkpoint_path)))} ({time.perf_counter() - start:.0f} s in all)")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint_path", type=Path, required=True)
    p.add_argument("--draft_checkpoint_path", type=Path, default=None)
    p.add_argument("--speculate_k", type=int, default=5)
    p.add_argument("--tree_nodes", type=int, default=None)
    p.add_argument("--draft_ngram", type=int, default=0, metavar="N")
    p.add_argument("--draft_head", type=Path, default=None, help="a draft head's directory: its graphs too")
    p.add_argument("--batch_size", type=int, nargs="+", default=[1], help="the batch sizes to build graphs for")
    p.add_argument("--compile", default="auto", choices=["auto", "autotune", "whole", "regional"],
                   help="auto / autotune: stored graphs on CPU; CUDA and the in-process modes store their kernels")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None)
    p.add_argument("--list", action="store_true", help="show what the compiled/ directories hold; build nothing")
    p.add_argument("--prune", action="store_true",
                   help="remove the stale artifacts (never loaded again); build nothing")
    return p.parse_args()


def report(rows: list):
    """Each built or found graph's time and size."""
    import artifacts
    print(f"{'model':60s} {'batch':>5s} {'s':>7s} {'MB':>8s}")
    for row in rows:
        directory = artifacts.directory_for(row["model"])
        size = sum(p.stat().st_size for p in directory.glob(f"{row['stem']}-b{row['batch']}of{row['batch']}-*.so"))
        size += sum(p.stat().st_size for p in directory.glob(f"{row['stem']}-kernels-*.bin"))
        print(f"{row['model']:60s} {row['batch']:5d} {row['seconds']:7.1f} {size / 1e6:8.1f}")


if __name__ == "__main__":
    sys.exit(run_cli(main))
