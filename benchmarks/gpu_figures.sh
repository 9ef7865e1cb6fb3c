#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md and the CUDA tests in one run: about twelve minutes on one H100, so the
# default budget below skips the last steps; set BUDGET_S to run them all.
#
#   bash benchmarks/gpu_figures.sh [OUT_DIR]        # default gpu_figures/
#
# Each step runs under its own time limit, and all of them within BUDGET_S seconds (default 540), so that one
# slow step cannot take the others with it; a step with too little time left is skipped and says so. Every step
# writes OUT_DIR/NAME.log and its JSON / PNG; with ARCHIVE=FILE.tgz the folder is also packed there after each
# step (for copying the results off a machine that may be taken back). Runs from a checkout without installing
# (PYTHONPATH=src); needs timm and transformers for the peers.
set -u
out=${1:-gpu_figures}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} MPLBACKEND=Agg PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 left
    shift 2
    left=$(( deadline - $(date +%s) ))
    (( left < limit )) && limit=$left
    if (( limit < 30 )); then
        echo "== $name: skipped, ${left}s left"
        return
    fi
    echo "== $name (at most ${limit}s): $*"
    local t0 rc
    t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - t0 ))s"
    tail -n 30 "$out/$name.log"
    if [[ -n "${ARCHIVE:-}" ]]; then tar czf "$ARCHIVE" "$out"; fi
}

step env 30 bash -c "nvidia-smi; $py -c 'import torch, transformers, timm; print(torch.__version__, \
torch.cuda.get_device_name(), transformers.__version__, timm.__version__)'; lscpu | grep -m1 'Model name'"

# Llama-2-7B config, random weights, bf16: prefill and decode tokens/s against transformers' generate, same weights
step llama2_7b_eager 150 "$py" benchmarks/llama_generate.py --model llama2_7b --device cuda --dtype bf16 \
    --warmup 1 --runs 3 --no-compile --json "$out/llama2_7b_generate_cuda_bf16.json"

# LLaVA-style fine-tuning throughput, bf16 autocast: the demo model in LLaVA's two stages and end to end
for stage in 1 2 0; do
    step "vlm_train_stage$stage" 60 "$py" benchmarks/vlm_train_throughput.py --model llava_scenes --device cuda \
        --amp bf16 --batch-size 256 --stage "$stage" --json "$out/vlm_train_cuda_bf16_stage$stage.json"
done

step cuda_tests 150 "$py" -m pytest -q -p no:cacheprovider tests/vlm/test_vlm_cuda.py \
    tests/models/test_models_cuda.py tests/clip/test_clip_cuda.py

# plain eager models against timm, bf16 autocast, batch 256
step models_eager 150 "$py" -m vitlab bench models vit_base_patch16_224 deit_tiny_patch16_224 \
    swin_tiny_patch4_window7_224 levit_256 cait_xxs24_224 --device cuda --dtype bf16 --batch-size 256 \
    --mode both --compare timm --no-optimize --runs 10 --quiet --json "$out/models_cuda_bf16_b256.json" \
    --plot "$out/models_cuda_bf16_b256.png"

step train_mfu 60 "$py" benchmarks/train_mfu.py --model vit_base_patch16_224 --amp bf16 --batch-size 256 \
    --steps 40 --skip 10 --device cuda --out "$out/train_mfu_vit_b16_cuda_bf16.json"

step mae 60 "$py" benchmarks/mae_throughput.py --out "$out/mae_vit_b16_cuda_bf16.json"

# the optimization ladder of ViT-B/16 training (each rung a fresh process; compiles)
step ladder 240 "$py" -m vitlab bench ladder vit_base_patch16_224 --device cuda --batch-size 64 --runs 5 \
    --warmup 2 --quiet --json "$out/ladder_vit_base_cuda.json" --plot "$out/ladder_vit_base_cuda.png"

# the Llama compiled by vitlab.optimize (Inductor) last: its compile time is the least certain
step llama2_7b_compiled 200 "$py" benchmarks/llama_generate.py --model llama2_7b --device cuda --dtype bf16 \
    --warmup 1 --runs 3 --json "$out/llama2_7b_generate_cuda_bf16_compiled.json"
echo "== done"
