#!/usr/bin/env bash
# Llama-2-70B target split over 8 GPUs (tensor parallelism), Llama-2-7B draft replicated on each,
# greedy, chain of 5. NGPU=2 or 4 for fewer GPUs (70B's 8 KV heads split over 2, 4 or 8 ranks).
set -euo pipefail
bash scripts/prepare.sh meta-llama/Llama-2-70b-chat-hf
bash scripts/prepare.sh meta-llama/Llama-2-7b-chat-hf
torchrun --nproc_per_node="${NGPU:-8}" generate.py --compile \
  --checkpoint_path checkpoints/meta-llama/Llama-2-70b-chat-hf/model.pth \
  --draft_checkpoint_path checkpoints/meta-llama/Llama-2-7b-chat-hf/model.pth \
  --speculate_k 5 --temperature 0 --prompt "Write a Python function that merges two sorted lists." "$@"
