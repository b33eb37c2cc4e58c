#!/usr/bin/env bash
# Learned placement against LRU on a model whose routing is real (fixtures/olmoe_trained):
# histories from each domain's training text, traces of each domain's held-out text, the
# simulator's table for every history x text pair, and the same placements live.
#
#   scripts/routing-study.sh [OUT_DIR]      (default /tmp/coli-routing-study)
#
# Every run decodes token ids one at a time (REPLAY=1), so each MoE call is one token's
# routing, as in decode. Needs target/release/coli (cargo build --release).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
coli="$root/target/release/coli"
snap="$root/fixtures/olmoe_trained"
out=${1:-/tmp/coli-routing-study}
experts=$(python3 -c "import json;print(json.load(open('$snap/config.json'))['num_experts'])")
slots="$((experts / 16)),$((experts / 8)),$((experts / 4)),$((experts / 2))"
mkdir -p "$out"
rm -f "$out"/*.coli_usage "$out"/*.trace "$out"/*.lock

replay() { # replay IDS_FILE [SETTING=VALUE...]
    local ids=$1
    shift
    "$coli" SNAP="$snap" IDS="$(cat "$ids")" REPLAY=1 "$@" 2>&1
}

for d in prose code; do
    # A history of the training text: what a user's past runs of that domain left.
    replay "$snap/train_$d.ids" COLI_USAGE="$out/$d.coli_usage" CAP="$experts" >/dev/null
    # The held-out text's routing, traced with every expert resident.
    replay "$snap/heldout_$d.ids" USAGE_SAVE=0 COLI_USAGE="$out/none.coli_usage" \
        ROUTE_TRACE="$out/heldout_$d.trace" CAP="$experts" >/dev/null
done

for text in prose code; do
    for hist in prose code; do
        echo "== held-out $text, history from $hist training text"
        "$coli" trace simulate "$out/heldout_$text.trace" --slots "$slots" \
            --history "$out/$hist.coli_usage"
    done
done

echo "== live: the engine's expert-cache line, experts streamed (pins take slots)"
echo "   lfru: COLI_POLICY=lfru PIN=auto PIN_N=0; pin+lru: PIN=auto PIN_N=<slots> PIN_ABSTAIN=0;"
echo "   guarded: the same with the abstain rule (default)"
rate() { grep -o 'hit rate: [0-9.]*%' | grep -o '[0-9.]*%'; }
for text in prose code; do
    for s in ${slots//,/ }; do
        lru=$(replay "$snap/heldout_$text.ids" USAGE_SAVE=0 COLI_USAGE="$out/none.coli_usage" \
            EXPERT_IO=pread PIN=off CAP="$s" | rate)
        for hist in prose code; do
            run() {
                replay "$snap/heldout_$text.ids" USAGE_SAVE=0 COLI_USAGE="$out/$hist.coli_usage" \
                    EXPERT_IO=pread PIN=auto PIN_N="$s" CAP="$s" "$@" | rate
            }
            # LFRU seeded from the history's heat, nothing pinned.
            lfru=$(replay "$snap/heldout_$text.ids" USAGE_SAVE=0 COLI_USAGE="$out/$hist.coli_usage" \
                EXPERT_IO=pread COLI_POLICY=lfru PIN=auto PIN_N=0 CAP="$s" | rate)
            echo "text $text slots $s history $hist: lru $lru | lfru $lfru | pin+lru $(run PIN_ABSTAIN=0) | guarded $(run)"
        done
    done
done

echo "== domain switch: a history of code, then 100 prose turns of 20 tokens (one save each)"
cp "$out/code.coli_usage" "$out/switch.coli_usage"
read -ra prose_ids < "$snap/train_prose.ids"
for turn in $(seq 0 99); do
    "$coli" SNAP="$snap" IDS="${prose_ids[*]:$((turn * 20)):20}" REPLAY=1 CAP="$experts" \
        COLI_USAGE="$out/switch.coli_usage" >/dev/null 2>&1
done
for s in $((experts / 8)) $((experts / 4)); do
    line="slots $s on held-out prose:"
    for rank in lifetime recent blend; do
        r=$(replay "$snap/heldout_prose.ids" USAGE_SAVE=0 COLI_USAGE="$out/switch.coli_usage" \
            EXPERT_IO=pread PIN=auto PIN_N="$s" CAP="$s" PIN_ABSTAIN=0 PIN_RANK="$rank" | rate)
        line="$line $rank $r"
    done
    echo "$line"
done
