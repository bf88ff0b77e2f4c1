#!/usr/bin/env bash
# Llama-2-70B target with a Llama-2-7B draft (same 32000-token vocabulary), greedy, chain of 5.
# Needs ~140 GB (bf16) for the target: on one GPU use an int8 target (python quantize.py --mode int8),
# or tensor parallelism (scripts/speculate_tp_70B.sh).
set -euo pipefail
bash scripts/prepare.sh meta-llama/Llama-2-70b-chat-hf
bash scripts/prepare.sh meta-llama/Llama-2-7b-chat-hf
python generate.py --compile \
  --checkpoint_path checkpoints/meta-llama/Llama-2-70b-chat-hf/model.pth \
  --draft_checkpoint_path checkpoints/meta-llama/Llama-2-7b-chat-hf/model.pth \
  --speculate_k 5 --temperature 0 --prompt "Write a Python function that merges two sorted lists." "$@"
