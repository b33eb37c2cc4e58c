#!/usr/bin/env bash
# Is more expert cache always faster? The real-shape OLMoE of the offload benchmark
# (int8-row, 4 layers, 1.89 GB of shards) decoded inside a memory cgroup at a share of its
# shard bytes, with the cache at the CAP=0 rule's slots and at 0.75x and 0.5x of them, each
# cold (page cache dropped first) and warm (run again at once), in ROUNDS interleaved rounds.
#
#   scripts/cache-size.sh [MODEL_DIR] [LIMIT_PERCENTS] [ROUNDS]
#       (defaults: /tmp/coli-olmoe-bench/int8-row-4l, "60 40", 2)
#
# The model is the one `cargo bench --bench offload` converts. Needs root (cgroups, cache
# drops) and target/release/coli. Prints one line per run: slots, tok/s, hit rate, MB read
# per token, the cgroup's peak.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
coli="$root/target/release/coli"
model=${1:-/tmp/coli-olmoe-bench/int8-row-4l}
limits=${2:-60 40}
rounds=${3:-2}
bytes=$(du -cb "$model"/*.safetensors | tail -1 | cut -f1)
ids=$(python3 -c "import random; random.seed(7); print(' '.join(str(random.randrange(50304)) for _ in range(132)))")
drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }
run() { # run LIMIT_BYTES CAP
    "$root/scripts/membox.sh" "$1" "$coli" SNAP="$model" IDS="$ids" REPLAY=1 NGEN=0 THREADS=2 \
        USAGE_SAVE=0 PIN=off CAP="$2" 2>&1
}
report() { # report LABEL OUTPUT
    local line slots peak
    line=$(echo "$2" | grep '^REPLAY decode')
    slots=$(echo "$2" | grep -o 'cache=[0-9]*' | head -1 | cut -d= -f2)
    peak=$(echo "$2" | grep -o 'peak [0-9]* MB' | head -1)
    echo "$1 slots $slots | $(echo "$line" | grep -o '[0-9.]* tok/s') | $(echo "$line" | grep -o 'hit [0-9.]*%') | $(echo "$line" | grep -o '[0-9.]* MB/token') | $peak"
}
for pct in $limits; do
    limit=$((bytes * pct / 100))
    drop
    rule=$(run "$limit" 0 | grep -o 'cache=[0-9]*' | head -1 | cut -d= -f2)
    echo "== limit $pct% ($((limit / 1000000)) MB): the CAP=0 rule gives $rule slots/layer"
    for round in $(seq "$rounds"); do
        for scale in 100 75 50; do
            cap=$((rule * scale / 100))
            [ "$cap" -ge 1 ] || cap=1
            drop
            report "round $round limit $pct% cap ${scale}% cold" "$(run "$limit" "$cap")"
            report "round $round limit $pct% cap ${scale}% warm" "$(run "$limit" "$cap")"
        done
    done
done
