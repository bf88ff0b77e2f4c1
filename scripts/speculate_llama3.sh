#!/usr/bin/env bash
# Llama-3.1-8B-Instruct target, Llama-3.2-1B-Instruct draft (same 128256-token vocabulary), a token
# tree of 16 nodes and depth 5, sampling at T=0.7 (lossless: samples are distributed as the target's).
set -euo pipefail
bash scripts/prepare.sh meta-llama/Llama-3.1-8B-Instruct
bash scripts/prepare.sh meta-llama/Llama-3.2-1B-Instruct
python generate.py --compile \
  --checkpoint_path checkpoints/meta-llama/Llama-3.1-8B-Instruct/model.pth \
  --draft_checkpoint_path checkpoints/meta-llama/Llama-3.2-1B-Instruct/model.pth \
  --speculate_k 5 --tree_nodes 16 --temperature 0.7 --top_p 0.95 \
  --prompt "Summarize the causes of the French Revolution." "$@"
