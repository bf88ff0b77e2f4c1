#!/usr/bin/env bash
# The offline main job: train the tiny target/draft pair if it is not there yet, then decode
# speculatively with the draft and print tokens/s, GB/s and the acceptance figures.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f checkpoints/tiny/target/model.pth ] || [ ! -f checkpoints/tiny/draft/model.pth ]; then
  python scripts/train_tiny.py --out_dir checkpoints/tiny
fi
python generate.py --compile \
  --checkpoint_path checkpoints/tiny/target/model.pth \
  --draft_checkpoint_path checkpoints/tiny/draft/model.pth --speculate_k 5 \
  --prompt "$(printf 'def parse_args(argv=None):\n    """Parse the command line."""\n')" \
  --temperature 0 --max_new_tokens 200 --num_samples 3 "$@"
