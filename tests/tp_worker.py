"""The torchrun worker of tests/test_tp.py: every rank loads each checkpoint whole and sharded, records the
logits of both, runs cli.main() for each named command line, and saves what it got as OUT/rank{r}.pt.

    torchrun --nproc_per_node=2 tests/tp_worker.py OUT '["ckpt/model.pth"]' '{"name": ["--checkpoint_path", ...]}'
"""
import functools
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # root, tests/
import generation  # noqa: E402
import tp  # noqa: E402
from helpers import load_cli  # noqa: E402


def worker(out_dir, checkpoints, runs):
    rank, world_size = tp.init_distributed("cpu")
    shard = functools.partial(tp.apply_tp, rank=rank, world_size=world_size)
    report = {"logits": {}, "runs": {}}
    for checkpoint in json.loads(checkpoints):
        single, sharded = generation.load_model(checkpoint), generation.load_model(checkpoint, shard=shard)
        attention = sharded.layers[0].attention
        report["logits"][checkpoint] = {
            "single": forward_and_decode(single), "tp": forward_and_decode(sharded),
            "q_heads": attention.n_head, "kv_heads": attention.kv_cache.k_cache.shape[1],
            "output_rows": sharded.output.weight.shape[0]}
    cli = load_cli()
    for name, argv in json.loads(runs).items():
        report["runs"][name] = cli.main(argv)
    torch.save(report, Path(out_dir) / f"rank{rank}.pt")


def forward_and_decode(model) -> list:
    """Logits of a 2-row, 7-token prefill and of 3 one-token decode steps, on fixed random tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.args.vocab_size
    model.setup_caches(2, 16)
    with torch.no_grad():
        logits = [model(torch.randint(vocab, (2, 7), generator=generator), torch.arange(7).repeat(2, 1))]
        for pos in range(7, 10):
            logits.append(model(torch.randint(vocab, (2, 1), generator=generator), torch.full((2, 1), pos)))
    return logits


if __name__ == "__main__":
    torch.set_num_threads(1)
    worker(*sys.argv[1:])
    tp.end_process()
