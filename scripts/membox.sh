#!/usr/bin/env bash
# membox.sh LIMIT CMD [ARGS...]
#
# Runs CMD in a fresh memory cgroup with a hard limit of LIMIT bytes (suffixes K/M/G or
# KB/MB/GB, powers of 1000, decimals allowed: 800M, 1.2G), as the out-of-core benchmark
# needs: page cache is charged to the cgroup as the kernel does, swap is disallowed
# (v2 memory.swap.max=0; v1 memory.memsw.limit_in_bytes where present). After CMD, one
# line on stderr:
#   membox: limit L MB | peak P MB | oom_kill K | exit E
# (MB = 10^6 bytes; peak is memory.peak on v2 where present, memory.max_usage_in_bytes
# on v1). Exits with CMD's status; the cgroup is removed afterwards, also on Ctrl-C.
# Needs root and a memory controller (cgroup v2, else v1); exits 2 without them.
# MEMBOX_DROP_CACHES=1 syncs and drops the page cache first (cold runs).
set -euo pipefail

die() { echo "membox: $*" >&2; exit 2; }
[ $# -ge 2 ] || die "usage: membox.sh LIMIT CMD [ARGS...]"
[ "$(id -u)" -eq 0 ] || die "needs root (it creates a cgroup)"

limit=$(awk -v s="$1" 'BEGIN {
  if (match(s, /^[0-9]+(\.[0-9]+)?/) == 0) exit 1
  n = substr(s, 1, RLENGTH); u = toupper(substr(s, RLENGTH + 1)); sub(/B$/, "", u)
  m = (u == "") ? 1 : (u == "K") ? 1e3 : (u == "M") ? 1e6 : (u == "G") ? 1e9 : 0
  if (m == 0 || n * m < 1) exit 1
  printf "%.0f\n", n * m }') || die "bad LIMIT '$1' (bytes, or K/M/G/KB/MB/GB)"
shift

# v2 where its root offers the memory controller; else the v1 memory hierarchy, nested
# under this shell's own memory cgroup.
v2=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
v1=$(awk '$3 == "cgroup" && $4 ~ /(^|,)memory(,|$)/ { print $2; exit }' /proc/mounts)
if [ -n "$v2" ] && grep -qw memory "$v2/cgroup.controllers" 2>/dev/null; then
  version=2
  grep -qw memory "$v2/cgroup.subtree_control" ||
    echo +memory >"$v2/cgroup.subtree_control" 2>/dev/null ||
    die "cannot enable the memory controller in $v2"
  cg=$v2/membox.$$
elif [ -n "$v1" ]; then
  version=1
  cg=$v1$(awk -F: '$2 ~ /(^|,)memory(,|$)/ { print $3; exit }' /proc/self/cgroup)
  cg=${cg%/}/membox.$$
else
  die "no cgroup memory controller found (v2 or v1)"
fi

cleanup() {
  [ -d "$cg" ] || return 0
  local pid
  for pid in $(cat "$cg/cgroup.procs" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir "$cg" 2>/dev/null && return 0; sleep 0.2; done
  echo "membox: could not remove $cg" >&2
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir "$cg" || die "cannot create $cg"
if [ $version = 2 ]; then
  echo "$limit" >"$cg/memory.max"
  [ -e "$cg/memory.swap.max" ] && echo 0 >"$cg/memory.swap.max"
else
  echo "$limit" >"$cg/memory.limit_in_bytes"
  [ -e "$cg/memory.memsw.limit_in_bytes" ] && echo "$limit" >"$cg/memory.memsw.limit_in_bytes"
  echo 0 >"$cg/memory.swappiness" 2>/dev/null || true
fi

if [ "${MEMBOX_DROP_CACHES:-0}" = 1 ]; then
  sync
  echo 3 >/proc/sys/vm/drop_caches
fi

# In the background so that a signal to this script is handled at once (the cleanup
# kills what is left in the cgroup); stdin passed on explicitly.
sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg" "$@" <&0 &
status=0
wait $! || status=$?

if [ $version = 2 ]; then
  peak=$(cat "$cg/memory.peak" 2>/dev/null || echo -1)
  kills=$(awk '$1 == "oom_kill" { print $2 }' "$cg/memory.events")
else
  peak=$(cat "$cg/memory.max_usage_in_bytes")
  kills=$(awk '$1 == "oom_kill" { print $2 }' "$cg/memory.oom_control")
fi
awk -v l="$limit" -v p="$peak" -v k="${kills:-?}" -v e="$status" 'BEGIN {
  printf "membox: limit %.0f MB | peak %s MB | oom_kill %s | exit %d\n",
    l / 1e6, (p < 0) ? "?" : sprintf("%.0f", p / 1e6), k, e }' >&2
exit "$status"
