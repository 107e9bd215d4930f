#!/usr/bin/env bash
# The vLLM 0.26 peer bundle (shared/tools/vllm-peer) in pieces small enough for the device's
# 64 MiB per call, which counts the checkout's tracked files (~18 MB) too, and its reassembly on
# the GPU machine.
#
# Here (a machine with pip access), once per checkout:
#   bash bench/vllm_bundle.sh split BUNDLE.tar.xz [SIZE]   # -> .vl0/ .vl1/ ... (SIZE as split -b takes it, default 31M)
# 31M makes three pieces of the 92 MB bundle, the last ~26 MB: that one fits beside the ~16 MB of
# staged wheels and dummy models in a lease's first (build) call, the other two each in a later
# call of the same lease, so staging costs no call of its own.
# (BUNDLE.tar.xz is build_vllm_bundle.sh's OUTDIR/vllm-bundle.tar.xz; --with-moe makes ~132 MB,
# three pieces.) .vl*/ is ignored by git (.gitignore).
#
# There, one device call per piece, each carrying its .vlN (and nothing as large beside it), on
# the same warm machine (chain the calls: it is given back after ~30 s idle):
#   bash bench/vllm_bundle.sh stage        # copies the carried .vl*/ into /tmp/vl; once all
#                                          # pieces are there (checksums), unpacks /tmp/site
# `stage` exits 0 with "vLLM ready in /tmp/site" or "N of M pieces staged"; bench/vllm_peer.sh and
# bench/multi_gpu_vs_vllm.sh then find vLLM in /tmp/site.
set -euo pipefail
cmd=${1:?usage: bash bench/vllm_bundle.sh split BUNDLE.tar.xz [SIZE] | stage}
cd "$(dirname "$0")/.."
case "$cmd" in
  split)
    bundle=${2:?usage: bash bench/vllm_bundle.sh split BUNDLE.tar.xz [SIZE]}
    size=${3:-31M}  # split -b's size
    tmp=$(mktemp -d)
    split -b "$size" -d -a 2 "$bundle" "$tmp/part."
    (cd "$tmp" && sha256sum part.* > PARTS.sha256)
    rm -rf .vl[0-9]*
    i=0
    for part in "$tmp"/part.*; do
      mkdir -p ".vl$i"
      cp "$part" "$tmp/PARTS.sha256" ".vl$i/"
      i=$((i + 1))
    done
    rm -rf "$tmp"
    echo "$i pieces: $(ls -d .vl[0-9]* | tr '\n' ' ')(carry one per device call)"
    ;;
  stage)
    vl=${VL_STAGE:-/tmp/vl} root=${VL_ROOT:-/tmp}  # where pieces gather / where site/ unpacks
    mkdir -p "$vl"
    for d in .vl[0-9]*/; do [ -d "$d" ] && cp "$d"* "$vl"/; done
    if [ -d "$root/site/vllm" ]; then echo "vLLM ready in $root/site"; exit 0; fi
    [ -f "$vl/PARTS.sha256" ] || { echo "no piece carried (.vl0/ ...)"; exit 1; }
    want=$(wc -l < "$vl/PARTS.sha256")
    have=$(find "$vl" -name 'part.*' | wc -l)
    if [ "$have" -lt "$want" ]; then echo "$have of $want pieces staged"; exit 0; fi
    (cd "$vl" && sha256sum --quiet -c PARTS.sha256)
    cat "$vl"/part.* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='fully_trusted')" "$root"
    echo "vLLM ready in $root/site"
    ;;
  *) echo "usage: bash bench/vllm_bundle.sh split BUNDLE.tar.xz [SIZE] | stage" >&2; exit 2 ;;
esac
