#!/usr/bin/env bash
# The CUDA device on a machine with an NVIDIA GPU, in one run of under five minutes:
#   1. release build; the CUDA kernel tests with --include-ignored (every format against
#      the CPU reference, RMSNorm, expert groups, uploads, and the matvec bandwidth probe);
#   2. every committed fixture with a ref.json, greedy, with BACKEND=cpu and BACKEND=cuda:
#      the oracle's "Matching tokens" line for both, and the tokens generated from the
#      reference prompt compared (f32 weights must agree; int8 is reported);
#   3. end-to-end decode on the real-shape OLMoE that benches/decode.rs writes (the bench
#      itself times the CPU), then the binary on it with BACKEND=cpu and BACKEND=cuda with
#      every expert in VRAM.
# Everything is written to the results file ($1, default gpu-check-results.txt); the exit
# status is non-zero when a test fails or a fixture's tokens differ.
#
# Environment: GPU_EXPERT_GB for the CUDA runs (default 8, more than the benchmark model's
# experts); BENCH_DIR for the benchmark model (default /tmp/coli-olmoe-bench); BENCH_ONLY
# for the benchmark's rows (default bf16,int8-row,int4-g64: the models the GPU runs use).
#
# A GPU machine without a Rust toolchain runs binaries built elsewhere (same architecture,
# an equal or newer glibc): `scripts/gpu-check.sh --prebuild DIR` builds them here into DIR,
# and `COLI_PREBUILT=DIR scripts/gpu-check.sh` there uses them instead of cargo.
# Where a Vulkan loader (libvulkan.so.1) is present, the fixtures run with BACKEND=vulkan too.
# LD_LIBRARY_PATH is extended with the directory of libnvrtc.so.12 when the loader does not
# already find it.
set -euo pipefail

cd "$(dirname "$0")/.."

# The path of the executable cargo built for "$@" (a --no-run test or bench build).
built_executable() {
    cargo "$@" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json, sys
for line in sys.stdin:
    message = json.loads(line)
    if message.get("reason") == "compiler-artifact" and message.get("executable") and message["target"]["kind"] != ["bin"]:
        print(message["executable"])' | tail -n 1
}

if [[ "${1:-}" == --prebuild ]]; then
    out="${2:?--prebuild needs a directory}"
    mkdir -p "$out"
    cargo build --release --quiet
    cp "${CARGO_TARGET_DIR:-target}/release/coli" "$out/coli"
    cp "$(built_executable test --release --test gpu)" "$out/gpu"
    cp "$(built_executable bench --bench decode)" "$out/decode"
    strip "$out"/* 2>/dev/null || true
    ls -l "$out"
    exit 0
fi

results="$(realpath -m "${1:-gpu-check-results.txt}")"
expert_gb="${GPU_EXPERT_GB:-8}"
bench_dir="${BENCH_DIR:-/tmp/coli-olmoe-bench}"
: >"$results"
failures=0

log() { printf '%s\n' "$*" | tee -a "$results"; }
section() { log ""; log "== $* ($((SECONDS))s)"; }
# Run a command with a time limit, its output appended to the results; a failure is
# counted, not fatal.
run_logged() {
    local limit="$1"
    shift
    if ! timeout "$limit" "$@" 2>&1 | tee -a "$results"; then
        log "FAILED (or timed out after ${limit}s): $*"
        failures=$((failures + 1))
    fi
}

# cudarc loads libnvrtc.so or libnvrtc.so.12 (or older), never CUDA 13's libnvrtc.so.13.
find_nvrtc() {
    # grep reads all of ldconfig's output (no -q): an early exit would fail the pipeline.
    if ldconfig -p 2>/dev/null | grep -E 'libnvrtc\.so(\.1[12])? ' >/dev/null; then
        return
    fi
    local candidate
    for candidate in /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/*/lib \
        /usr/lib/x86_64-linux-gnu /usr/lib64 \
        $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null | sed 's|\([^ ]*\)|\1/nvidia/cuda_nvrtc/lib|g'); do
        if [[ -e "$candidate/libnvrtc.so" ]] || compgen -G "$candidate/libnvrtc.so.1[12]" >/dev/null; then
            export LD_LIBRARY_PATH="$candidate${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            log "libnvrtc from $candidate"
            return
        fi
    done
    log "libnvrtc.so.12 not found; the CUDA device can only start from a cached PTX"
}

section "machine"
log "$(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1 | tee -a "$results" || true
find_nvrtc

prebuilt="${COLI_PREBUILT:-}"
if [[ -n "$prebuilt" ]]; then
    prebuilt="$(realpath "$prebuilt")"
    coli="$prebuilt/coli"
    kernel_tests=("$prebuilt/gpu" cuda_kernels::)
    decode_bench=("$prebuilt/decode" --bench)
    log "prebuilt binaries from $prebuilt"
else
    section "build"
    run_logged 240 cargo build --release --quiet
    run_logged 240 cargo test --release --quiet --test gpu --no-run
    coli=target/release/coli
    if [[ -n "${CARGO_TARGET_DIR:-}" ]]; then
        coli="$CARGO_TARGET_DIR/release/coli"
    fi
    kernel_tests=(cargo test --release --test gpu -- cuda_kernels::)
    decode_bench=(cargo bench --quiet --bench decode --)
fi

section "kernel tests"
run_logged 180 "${kernel_tests[@]}" --include-ignored --nocapture --test-threads 2

# The token ids an IDS run prints (its only line of bare numbers).
tokens() { timeout 60 "$@" 2>/dev/null | grep -E '^[0-9]+( [0-9]+)*$' | head -n 1 || true; }

gpu_backends=(cuda)
if ldconfig -p 2>/dev/null | grep 'libvulkan\.so\.1 ' >/dev/null; then
    gpu_backends+=(vulkan)
else
    log "no Vulkan loader (libvulkan.so.1): the fixtures run on CUDA alone"
fi

section "fixtures (greedy, cpu vs ${gpu_backends[*]})"
for dir in fixtures/*/; do
    dir="${dir%/}"
    [[ -f "$dir/ref.json" ]] || continue
    ids="$(python3 -c 'import json, sys; print(" ".join(map(str, json.load(open(sys.argv[1]))["prompt_ids"])))' "$dir/ref.json")"
    # The oracle prints "Matching tokens: N/M".
    for backend in cpu "${gpu_backends[@]}"; do
        line="$(BACKEND=$backend GPU_EXPERT_GB=$expert_gb timeout 60 "$coli" SNAP="$dir" USAGE_SAVE=0 64 16 16 2>&1 | grep -E 'Matching tokens|rror' | head -n 2 | tr '\n' ' ' || true)"
        log "$dir oracle BACKEND=$backend: $line"
    done
    for bits in 16 8; do
        cpu="$(BACKEND=cpu tokens "$coli" SNAP="$dir" USAGE_SAVE=0 NGEN=16 IDS="$ids" 64 "$bits" "$bits")"
        for backend in "${gpu_backends[@]}"; do
            gpu="$(BACKEND=$backend GPU_EXPERT_GB=$expert_gb tokens "$coli" SNAP="$dir" USAGE_SAVE=0 NGEN=16 IDS="$ids" 64 "$bits" "$bits")"
            if [[ -n "$cpu" && "$cpu" == "$gpu" ]]; then
                log "$dir ${bits}-bit $backend: same tokens: $gpu"
            else
                log "$dir ${bits}-bit $backend: DIFFERENT tokens"
                log "  cpu:  $cpu"
                log "  $backend: $gpu"
                # The fixtures guarantee a logit margin at full precision only; int8 weights
                # may let the summation order flip a close argmax, so that is reported only.
                if [[ $bits == 16 || -z "$gpu" ]]; then
                    failures=$((failures + 1))
                fi
            fi
        done
    done
done

section "decode benchmark (real-shape OLMoE, 4 layers)"
# The benchmark writes and converts the model once (kept in $bench_dir) and times the CPU
# kernels on it, the figure the GPU runs below are compared with.
run_logged 200 "${decode_bench[@]}" --layers 4 --dir "$bench_dir" --repeat 1 --only "${BENCH_ONLY:-bf16,int8-row,int4-g64}"
# The same model through the binary: a 32-token prompt and 64 greedy tokens.
prompt="$(seq 100 131 | tr '\n' ' ')"
for model in int8-row-4l int4-g64-4l bf16-4l; do
    [[ -d "$bench_dir/$model" ]] || continue
    for backend in "${gpu_backends[@]}" cpu; do
        line="$(BACKEND=$backend GPU_EXPERT_GB=$expert_gb timeout 120 "$coli" SNAP="$bench_dir/$model" USAGE_SAVE=0 NGEN=64 IDS="$prompt" 64 16 16 2>&1 | grep -E 'tok/s|rror' | tail -n 1 || true)"
        log "$model BACKEND=$backend: $line"
    done
done

section "done"
log "failures: $failures"
[[ $failures -eq 0 ]]
