#!/usr/bin/env bash
# What each weight format and int8 activations cost, as perplexity and KL divergence
# against the f32 run of the same weights (PPL=1 KLD_BASE=...):
#   - the trained fixture (fixtures/olmoe_trained) on the held-out text of both domains
#     (the reference's perplexity ids: 256 tokens each, windows of 128 every 64), loaded at
#     f32, int8-row (EBITS/DBITS 8), int4-g64 experts with int8 dense (4 8) and int4-g64
#     everywhere (4 4), and converted to int4-row (one scale per row), int4-g64 with an
#     int8 embedding and head, FP8 everywhere, MXFP4 experts with int8 dense weights and
#     MXFP4 everywhere with an int8 embedding and head;
#   - the real-shape OLMoE of `cargo bench --bench decode` (random bf16 weights, so random
#     text: 256 random ids) as its bf16 source at f32 and its int8-row, int4-g64, fp8 and
#     mxfp4 containers, when BENCH_DIR holds them (`cargo bench --bench decode` writes them).
# Each integer format and MXFP4 runs with f32 activations and with ACT_BITS=8; FP8 has f32
# activations only (ACT_BITS=8 multiplies integer and MXFP4 weights).
#
#   scripts/quality.sh [OUT_DIR]    (default /tmp/coli-quality; BENCH_DIR=/tmp/coli-olmoe-bench)
#
# Needs target/release/coli (cargo build --release).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
coli="$root/target/release/coli"
out=${1:-/tmp/coli-quality}
bench=${BENCH_DIR:-/tmp/coli-olmoe-bench}
mkdir -p "$out"
rm -f "$out"/*.kld

kld() { grep -E '^(PPL|KLD):' | sed -E 's/ \| [0-9]+ tokens forwarded.*//'; }

score() { # score LABEL SNAP IDS CTX STRIDE BASE BITS... [ACT_BITS=8]
    local label=$1 snap=$2 ids=$3 ctx=$4 stride=$5 base=$6
    shift 6
    echo "-- $label $*"
    "$coli" SNAP="$snap" PPL=1 IDS="$ids" CTX="$ctx" PPL_STRIDE="$stride" USAGE_SAVE=0 \
        KLD_BASE="$base" "$@" 2>&1 | kld
}

trained="$root/fixtures/olmoe_trained"
convert() { # convert NAME ARGS...
    local name=$1
    shift
    [ -d "$out/olmoe_trained-$name" ] || "$coli" convert "$trained" "$out/olmoe_trained-$name" "$@" >/dev/null
}
convert int4-row --bits 4 --group-size 0 --io-bits 8
convert int4-g64-io8 --bits 4 --io-bits 8
convert fp8 --bits fp8
convert mxfp4-experts --expert-bits mxfp4 --dense-bits 8
convert mxfp4 --bits mxfp4
for domain in prose code; do
    ids=$(python3 -c "import json;r=json.load(open('$trained/ref.json'));print(','.join(map(str,r['ppl']['$domain']['ids'])))")
    base="$out/trained-$domain.kld"
    echo "== olmoe_trained, held-out $domain"
    score "f32 (base)" "$trained" "$ids" 128 64 "$base" 64 16 16
    for act in 32 8; do
        for bits in "8 8" "4 8" "4 4"; do
            # shellcheck disable=SC2086
            score "EBITS/DBITS $bits" "$trained" "$ids" 128 64 "$base" 64 $bits ACT_BITS=$act
        done
        for container in int4-row int4-g64-io8; do
            score "$container container" "$out/olmoe_trained-$container" "$ids" 128 64 "$base" \
                64 8 8 ACT_BITS=$act
        done
    done
    score "fp8 container" "$out/olmoe_trained-fp8" "$ids" 128 64 "$base" 64 16 16
    for act in 32 8; do
        for container in mxfp4-experts mxfp4; do
            score "$container container" "$out/olmoe_trained-$container" "$ids" 128 64 "$base" \
                64 8 8 ACT_BITS=$act
        done
    done
done

if [ -d "$bench/bf16-4l" ]; then
    ids=$(python3 -c "import random;random.seed(20261201);print(','.join(str(random.randrange(50304)) for _ in range(256)))")
    base="$out/real-shape.kld"
    echo "== real-shape OLMoE (4 layers, random weights), 256 random ids"
    score "bf16 source at f32 (base)" "$bench/bf16-4l" "$ids" 128 64 "$base" 64 16 16
    for act in 32 8; do
        for container in int8-row int4-g64; do
            score "$container container" "$bench/$container-4l" "$ids" 128 64 "$base" 64 8 8 \
                ACT_BITS=$act
        done
    done
    if [ -d "$bench/fp8-4l" ]; then
        score "fp8 container" "$bench/fp8-4l" "$ids" 128 64 "$base" 64 16 16
    fi
    if [ -d "$bench/mxfp4-4l" ]; then
        for act in 32 8; do
            score "mxfp4 container" "$bench/mxfp4-4l" "$ids" 128 64 "$base" 64 8 8 ACT_BITS=$act
        done
    fi
fi
