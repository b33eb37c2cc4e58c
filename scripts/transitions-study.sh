#!/usr/bin/env bash
# Expert transitions as a read-ahead, live, on a model whose routing is real
# (fixtures/olmoe_trained): a history of each domain's training text (per-expert counts and
# the -3/-4 transition records), then that domain's held-out text decoded one token at a
# time with experts streamed (EXPERT_IO=pread, no pins), at 2, 4, 8 and 16 slots, with no
# read-ahead, the router lookahead (PILOT=1), the transitions (TRANSITIONS=1), and both.
#
#   scripts/transitions-study.sh [OUT_DIR]      (default /tmp/coli-transitions-study)
#
# Prints one line per run: the REPLAY line's hit rate, MB read per token and tok/s, and the
# PROFILE line's prefetch precision and recall. Needs target/release/coli.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
coli="$root/target/release/coli"
snap="$root/fixtures/olmoe_trained"
out=${1:-/tmp/coli-transitions-study}
mkdir -p "$out"
rm -f "$out"/*.coli_usage "$out"/*.lock

replay() { # replay IDS_FILE [SETTING=VALUE...]
    local ids=$1
    shift
    "$coli" SNAP="$snap" IDS="$(cat "$ids")" REPLAY=1 "$@" 2>&1
}

for d in prose code; do
    start=$(date +%s.%N)
    replay "$snap/train_$d.ids" COLI_USAGE="$out/$d.coli_usage" CAP=32 >/dev/null
    h="$out/$d.coli_usage"
    all=$(wc -c <"$h")
    tr=$(grep -E '^-(3|4) ' "$h" | wc -c)
    groups=$(grep -c '^-3 ' "$h")
    edges=$(grep -c '^-4 ' "$h")
    echo "history $d: $all bytes, of which transitions $tr bytes ($groups groups, $edges edges)"
done

field() { grep -o "$1" | head -1; }
for text in prose code; do
    for slots in 2 4 8 16; do
        for mode in none pilot transitions both; do
            case $mode in
            none) set -- PILOT=0 TRANSITIONS=0 ;;
            pilot) set -- PILOT=1 TRANSITIONS=0 ;;
            transitions) set -- PILOT=0 TRANSITIONS=1 ;;
            both) set -- PILOT=1 TRANSITIONS=1 ;;
            esac
            log=$(replay "$snap/heldout_$text.ids" USAGE_SAVE=0 COLI_USAGE="$out/$text.coli_usage" \
                EXPERT_IO=pread PIN=off CAP="$slots" "$@")
            line=$(echo "$log" | grep '^REPLAY decode')
            hit=$(echo "$line" | grep -o 'hit [0-9.]*%' | grep -o '[0-9.]*%')
            mb=$(echo "$line" | grep -o '[0-9.]* MB/token' | grep -o '^[0-9.]*')
            tps=$(echo "$line" | grep -o '[0-9.]* tok/s' | grep -o '^[0-9.]*')
            prec=$(echo "$log" | grep -o '[0-9.]*% of [0-9]* predictions right' || true)
            rec=$(echo "$log" | grep -o '[0-9.]*% of the [0-9]* experts predicted layers took were predicted' || true)
            echo "text $text slots $slots $mode: hit $hit | $mb MB/token | $tps tok/s | precision ${prec:--} | recall ${rec:--}"
        done
    done
done
