#!/usr/bin/env bash
# System libraries pip cannot install. Mooncake's CPU build (the KV transfer of
# prefill/decode disaggregation) links libibverbs.so.1, Debian/Ubuntu package libibverbs1.
# Present: silent. Missing, as root with apt: installs it. Otherwise: one line saying
# what to run, exit 1. Runs on every `make install` (cheap), so a machine that lost the
# library is fixed too.
set -euo pipefail
export PATH="$PATH:/sbin:/usr/sbin"  # ldconfig, for users whose PATH lacks them

LIB=libibverbs.so.1
PKG=libibverbs1

have_lib() {
    local cache
    cache=$(ldconfig -p 2>/dev/null) || return 1
    [[ $cache == *"$LIB "* ]]
}

if ! command -v ldconfig >/dev/null; then
    echo "dsakv: cannot check for $LIB (no ldconfig); Mooncake's KV transfer needs it" >&2
    exit 0
fi
have_lib && exit 0

if command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    echo "dsakv: installing $PKG ($LIB, needed by Mooncake's KV transfer) with apt-get" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$PKG" >/dev/null
    have_lib && exit 0
    echo "error: installed $PKG but ldconfig still does not list $LIB" >&2
    exit 1
fi

sudo=""
[[ $(id -u) == 0 ]] || sudo="sudo "
if command -v apt-get >/dev/null; then
    run="${sudo}apt-get update && ${sudo}apt-get install -y $PKG"
elif command -v dnf >/dev/null; then
    run="${sudo}dnf install -y libibverbs"
else
    run="install your distribution's package that provides $LIB (Debian/Ubuntu: $PKG)"
fi
echo "error: $LIB is missing (Mooncake's KV transfer needs it); run: $run" >&2
exit 1
