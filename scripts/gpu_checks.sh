#!/usr/bin/env bash
# The checks that need a CUDA GPU, in stages that each fit a 10-minute run. From the repository root:
#
#   bash scripts/gpu_checks.sh STAGE [STAGE ...]      results (logs, JSON tables) go to $OUT, else ./gpu_results
#
#   quick    ONE command of at most 8 minutes (start-up excluded) that measures what matters first, each sub-step
#            under its own time budget (`timeout`, 455 s in all), figures to $OUT/quick.json, the table for
#            docs/performance.md to $OUT/quick.md, the log to $OUT/quick.log (scripts/gpu_quick.py): env (versions,
#            TF32, the backend each head type selects), kernel (the Triton kernel's values and gradients in bf16, fp32,
#            fp16 vs float64), train (343M shapes at 8 layers, bf16, vs Llama, 2048 and 4096 tokens), decode (343M,
#            ms/token after 1k tokens vs Llama), backends (the train step with relational heads on flex_attention and
#            on sdpa), serve (scripts/benchmark_serve.py: 16 requests, continuous batching vs sequential and padded
#            generate, DAT vs Llama, bf16). `GPU_CHECKS_DRY_RUN=1` runs it on CPU (Triton's interpreter, tiny shapes): the suite does.
#   env      GPU, driver and package versions; dat_hf imports and picks the triton backend on CUDA
#   kernel   the Triton kernel's checks on CUDA tensors (tests/triton_kernel_checks.py, compiled kernels)
#   fsdp     FSDP2 by hand on CUDA, 2 processes (tests/test_fsdp.py::test_save_pretrained_of_a_model_sharded_by_hand)
#   tp       tensor parallelism on CUDA with NCCL, one rank per GPU (tests/test_tensor_parallel.py's 2-process check:
#            every family vs one process); needs 2 GPUs, and says so on a machine with one
#   sdpa     343M shapes, bf16, train step at 4096 with the relational heads on SDPA (fused values of width
#            head_dim + R * d_r): does SDPA keep a fused kernel at that width (the run fails if it needs the math one)
#   train    343M shapes, bf16, train step and peak memory vs Llama at 1024, 2048, 4096 and 8192 tokens
#   decode_op  one decoding step of DAT-343M's relational heads over 8,192 slots (bf16): the Triton kernel with its
#            senders split among programs and with one program per row, beside SDPA over 16 heads, with bandwidths
#   decode   343M, bf16, ms/token after 1k and 8k prompts (dynamic cache), then compiled static-cache decoding
#            (one graph for every step, held by CUDA graphs: counted in the table)
#   decode_window  343M, bf16, compiled decoding after an 8k prompt with a sliding window of 256 on every head (its
#            cache keeps the window: CUDA graphs must hold the shifting update) vs the same model causal
#   flex     the flex_attention backends on CUDA (tests/flex_attention_checks.py: models vs eager, values and
#            gradients, every relational bias; generation; 343M shapes compile in bf16)
#   flex_train  343M shapes, bf16: train step vs Llama with every head on FlexAttention, 2048 and 4096 tokens
#   reference  343M shapes, bf16: dat_hf (converted weights) vs the authors' `dual-attention`, train step at 1024-4096
#            and decoding after a 1k prompt; needs its wheels in .whl/ if the machine lacks the package:
#            `pip download --no-deps -d .whl dual_attention==0.0.7 einops` (carried as an ignored path)
#
# The other stages take about 40 minutes of a GPU; with less (a session's 30 minutes, 10 per command), run `quick`
# first, then in this order, one command per group: `env kernel fsdp decode_op`, `train`, `decode`, `sdpa flex`,
# `decode_window flex_train reference`.
#
# SDPA's math fallback is forbidden in every benchmark run on CUDA (`--sdpa-math forbid`, the default there): a call
# that needs it fails the run and the table says so. Wheels in .whl/ (or $GPU_CHECKS_WHEELS) are installed first into
# /tmp/site (or $GPU_CHECKS_SITE), each only where the machine lacks its package or has an older version
# (scripts/wheels_to_install.py says which). The lent H100/H200 image was read with torch 2.11, triton 3.6,
# transformers 5.17, accelerate 1.15, tokenizers 0.23, safetensors 0.8, huggingface_hub 1.33 and einops (the device
# notes, 2026-11): at dat_hf's floors, so nothing needs carrying but `dual_attention` for `reference` and
# transformers 5.25 (its other needs the image meets) for the quick stage's serve step (DAT's continuous batching
# runs on the paged cache of 5.24 on; without it the step fails at once, naming the wheel): before a lent run,
# `pip download --no-deps -d .whl transformers==5.25.0` here, and carry `.whl`. The quick stage's env step prints
# what the machine has. CI's floor leg runs the kernel's checks (interpreted, and compiled for sm_90 with
# Triton's own ptxas) and this quick stage's dry run with that Triton, 3.6.0, and Transformers 5.17.
#
# No TP=1 row: Transformers (5.17 to 5.25) loads `tp_plan="auto"` at a world size of 1 as a plain model (no process
# group, no DTensor, no hooks: its tp_size > 1 tests), so it would repeat the decode row; tensor parallelism needs
# the `tp` stage's 2 GPUs.
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ]; then  # (tests/test_gpu_quick.py) CPU tensors through Triton's interpreter
    export TRITON_INTERPRET=1 DAT_HF_CPU_KERNEL=0
fi
WHEELS=${GPU_CHECKS_WHEELS:-.whl}
export GPU_CHECKS_SITE=${GPU_CHECKS_SITE:-/tmp/site}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    mapfile -t NEEDED < <(python3 scripts/wheels_to_install.py "$WHEELS")
    if [ "${#NEEDED[@]}" -gt 0 ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target \
            "$GPU_CHECKS_SITE" "${NEEDED[@]}" || { echo "installing the carried wheels failed: ${NEEDED[*]}" >&2
                                                   exit 3; }
        export PYTHONPATH="$GPU_CHECKS_SITE:$PYTHONPATH"
    fi
fi
BENCH=(python3 scripts/benchmark.py)
CUDA=(--device cuda --dtype bf16 --preset dat-343m --impls dat_hf llama --threads 8)

stage() {
    local name=$1
    shift
    echo "=== $name: $*"
    local start=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc $rc, $((SECONDS - start)) s"
    return "$rc"
}

# the quick stage's sub-steps and their time budgets in seconds (455 in all; e.g. GPU_CHECKS_QUICK_BUDGETS="env:60
# kernel:150" to change some), in the order they run
QUICK_BUDGETS=(env:30 kernel:125 train:100 decode:60 backends:95 serve:40 report:5)
for budget in ${GPU_CHECKS_QUICK_BUDGETS:-}; do
    QUICK_BUDGETS=("${QUICK_BUDGETS[@]/#${budget%%:*}:*/$budget}")
done

quick_step() {  # NAME BUDGET: one sub-step, stopped at its budget (exit status 124, what it measured is kept)
    local name=$1 budget=$2 start=$SECONDS rc
    echo "--- quick $name: budget $budget s"
    timeout -k 5 "$budget" python3 scripts/gpu_quick.py "$name" --out "$OUT"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "--- quick $name: STOPPED at its budget of $budget s"
    fi
    echo "--- quick $name: rc $rc, $((SECONDS - start)) s"
    python3 scripts/gpu_quick.py mark --out "$OUT" --name "$name" --rc "$rc" --seconds $((SECONDS - start)) \
        --budget "$budget"
    return "$rc"
}

run_quick() {
    local failed=0 step
    rm -f "$OUT/quick.json" "$OUT/quick.md"
    for step in "${QUICK_BUDGETS[@]}"; do
        quick_step "${step%%:*}" "${step##*:}" || failed=1
    done
    return $failed
}

status=0
for name in "$@"; do
    case $name in
        quick)
            stage quick run_quick || status=1 ;;
        env)
            stage env bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "
import torch, transformers, triton, accelerate, dat_hf
from dat_hf import DATForCausalLM
from dat_hf.training import load_preset_config
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__,
      \"triton\", triton.__version__, \"accelerate\", accelerate.__version__, \"dat_hf\", dat_hf.__version__)
model = DATForCausalLM(load_preset_config(\"dat-tiny\")).cuda()
model(torch.randint(0, 64, (1, 32), device=\"cuda\"))
print(\"relational backend on CUDA:\", model.model.layers[0].dual_attn.relational.relational_attention_backend)
"' || status=1 ;;
        kernel)  # (correctness over many shapes: one config each, not an autotuning run per shape)
            stage kernel env DAT_HF_TRITON_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider \
                tests/triton_kernel_checks.py || status=1 ;;
        fsdp)
            stage fsdp env DAT_HF_FSDP_DEVICE=cuda DAT_HF_TRITON_AUTOTUNE=0 python3 -m pytest -q -s \
                -p no:cacheprovider tests/test_fsdp.py -k sharded_by_hand || status=1 ;;
        tp)
            if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
                echo "=== tp: needs 2 GPUs, this machine has $(nvidia-smi -L 2>/dev/null | wc -l): not run"
            else
                stage tp python3 -m pytest -q -s -p no:cacheprovider tests/test_tensor_parallel.py || status=1
            fi ;;
        sdpa)
            stage sdpa "${BENCH[@]}" train "${CUDA[@]}" --impls dat_hf --relational-backend sdpa --seq 4096 \
                --steps 3 --out "$OUT/sdpa" || status=1 ;;
        train)
            stage train "${BENCH[@]}" train "${CUDA[@]}" --seq 1024 2048 4096 8192 --steps 3 --repeats 1 \
                --out "$OUT/train" || status=1 ;;
        decode_op)
            stage decode_op python3 scripts/benchmark_decode_op.py --device cuda --dtype bf16 --heads 8 --kv-heads 4 \
                --head-dim 64 --relations 8 --relation-dim 64 --slots 8192 --position 8100 --window 256 \
                --repeats 20 || status=1 ;;
        decode)
            stage decode "${BENCH[@]}" generate "${CUDA[@]}" --prompt 1024 8192 --new-tokens 128 --repeats 1 \
                --out "$OUT/decode" || status=1
            # (the table counts the graphs the timed run compiled and those run without CUDA graphs; the log says why)
            stage decode_compiled env TORCH_LOGS=recompiles,perf_hints "${BENCH[@]}" generate "${CUDA[@]}" \
                --prompt 1024 --new-tokens 128 --compile --out "$OUT/decode_compiled" || status=1 ;;
        decode_window)
            stage decode_window env TORCH_LOGS=recompiles,perf_hints "${BENCH[@]}" generate "${CUDA[@]}" \
                --impls dat_hf dat_hf_causal --relational-bias sliding_window --window 256 --prompt 8192 \
                --new-tokens 128 --compile --out "$OUT/decode_window" || status=1 ;;
        flex)
            stage flex python3 -m pytest -q -s -p no:cacheprovider tests/flex_attention_checks.py || status=1 ;;
        flex_train)
            stage flex_train "${BENCH[@]}" train "${CUDA[@]}" --attn flex_attention \
                --relational-backend flex_attention --seq 2048 4096 --steps 3 --out "$OUT/flex_train" || status=1 ;;
        reference)
            stage reference "${BENCH[@]}" train "${CUDA[@]}" --impls dat_hf reference --seq 1024 2048 4096 \
                --reference-max-seq 4096 --steps 3 --out "$OUT/reference" || status=1
            stage reference_decode "${BENCH[@]}" generate "${CUDA[@]}" --impls dat_hf reference --prompt 1024 \
                --new-tokens 32 --out "$OUT/reference_decode" || status=1 ;;
        *)
            echo "unknown stage $name (quick, env, kernel, fsdp, tp, sdpa, train, decode_op, decode, decode_window, flex," \
                "flex_train, reference)" >&2
            status=2 ;;
    esac
done
exit $status
