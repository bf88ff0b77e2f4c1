#!/usr/bin/env bash
# Llama-3.1-70B-Instruct target split over 8 GPUs (tensor parallelism), Llama-3.2-1B-Instruct draft
# (same 128256-token vocabulary) replicated on each, a token tree of 16 nodes and depth 5, T=0.7.
# INT8=1: quantize the target to int8 first (half the bytes per token; fits 4 x 40 GB with NGPU=4).
set -euo pipefail
bash scripts/prepare.sh meta-llama/Llama-3.1-70B-Instruct
bash scripts/prepare.sh meta-llama/Llama-3.2-1B-Instruct
target=checkpoints/meta-llama/Llama-3.1-70B-Instruct/model.pth
if [ "${INT8:-0}" = 1 ]; then
  python quantize.py --checkpoint_path "$target" --mode int8
  target=checkpoints/meta-llama/Llama-3.1-70B-Instruct/model_int8.pth
fi
torchrun --nproc_per_node="${NGPU:-8}" generate.py --compile \
  --checkpoint_path "$target" \
  --draft_checkpoint_path checkpoints/meta-llama/Llama-3.2-1B-Instruct/model.pth \
  --speculate_k 5 --tree_nodes 16 --temperature 0.7 --top_p 0.95 \
  --prompt "Summarize the causes of the French Revolution." "$@"
