#!/usr/bin/env bash
# mpi-bench.sh MODEL LIMIT [TOKENS]
#
# The MPI benchmark (docs/benchmarks.md): REPLAY decode of TOKENS random ids (default 64,
# seed 1) on the model in MODEL, first as one process in a memory cgroup of LIMIT bytes
# (scripts/membox.sh), then as `mpirun -np 3` with every rank in a cgroup of its own of
# LIMIT bytes; the page cache is dropped before each. Prints each run's REPLAY, cache and
# PROFILE lines and membox's peak. Needs root, a build with `--features mpi`
# (COLI=target/release/coli by default) and Open MPI's mpirun.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: mpi-bench.sh MODEL LIMIT [TOKENS]" >&2; exit 2; }
model=$1 limit=$2 tokens=${3:-64}
cd "$(dirname "$0")/.."
coli=${COLI:-target/release/coli}
vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$model/config.json")
ids=$(python3 -c "import random; random.seed(1); print(' '.join(str(random.randrange($vocab)) for _ in range($tokens)))")
settings=("SNAP=$model" "IDS=$ids" REPLAY=1 NGEN=0 USAGE_SAVE=0 CAP=0)
show() { grep -E "^(REPLAY|Expert cache|PROFILE)|membox:|\[mpi\]|\[experts\]" || true; }
cold() { sync; echo 3 >/proc/sys/vm/drop_caches; }

echo "== one process, THREADS=2, limit $limit (load $(cut -d' ' -f1-3 /proc/loadavg))"
cold
scripts/membox.sh "$limit" "$coli" "${settings[@]}" THREADS=2 2>&1 | show
echo "== mpirun -np 3, THREADS=1 a rank, each rank limited to $limit (load $(cut -d' ' -f1-3 /proc/loadavg))"
cold
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  OMPI_MCA_btl_vader_single_copy_mechanism=none \
  mpirun --oversubscribe -np 3 scripts/membox.sh "$limit" "$coli" "${settings[@]}" THREADS=1 2>&1 | show
