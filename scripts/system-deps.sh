#!/usr/bin/env bash
# What a make target needs from the machine, outside the virtual environment: checked, and
# installed when that can be done without asking (root with apt-get, or rustup for Rust's own
# components); otherwise one line that names what is missing and the command that adds it.
#
#   scripts/system-deps.sh build   # make build / demo: cargo, a C compiler, Python's venv
#   scripts/system-deps.sh test    # make test: build's, and clippy, rustfmt, then the libraries
#                                  # Mooncake's wheel loads (libibverbs, libnuma, libcurl: even
#                                  # over TCP) and what SGLang's page-hash extension compiles
#                                  # with (g++, OpenSSL's headers), and the coordination
#                                  # service router replicas share (redis-server)
#
# Exit status 0 when everything is there (after installing it), 2 when something is missing.
set -euo pipefail

usage() {
    echo "usage: $0 build|test" >&2
    exit 2
}
[[ $# -eq 1 ]] || usage
case $1 in build | test) ;; *) usage ;; esac
target=$1
python=${PYTHON:-python3}

fail() {
    echo "make $target: $*" >&2
    exit 2
}

has_lib() { # a shared library the dynamic loader finds
    local ldconfig
    ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
    if [[ -x $ldconfig ]] && "$ldconfig" -p 2>/dev/null | grep -q " $1 "; then
        return 0
    fi
    compgen -G "/usr/lib/*/$1" >/dev/null || compgen -G "/usr/lib/$1" >/dev/null ||
        compgen -G "/lib/*/$1" >/dev/null
}

# Each check: "Debian package|how to test for it".
checks=(
    "gcc|command -v cc"
    "python3-venv|$python -c 'import ensurepip, venv'"
)
if [[ $target == test ]]; then
    checks+=(
        "libibverbs1|has_lib libibverbs.so.1"
        "libnuma1|has_lib libnuma.so.1"
        "libcurl4|has_lib libcurl.so.4"
        "g++|command -v g++"
        "libssl-dev|test -e /usr/include/openssl/sha.h"
        "redis-server|command -v redis-server"
    )
fi

missing() {
    local check out=()
    for check in "${checks[@]}"; do
        eval "${check#*|}" >/dev/null 2>&1 || out+=("${check%%|*}")
    done
    echo "${out[*]}"
}

# Rust first: nothing else helps without it, and apt-get's rustc is not the toolchain we build with.
if ! command -v cargo >/dev/null 2>&1; then
    fail "cargo not found: install Rust with rustup (https://rustup.rs), then run make $target again"
fi
if [[ $target == test ]]; then
    for component in clippy rustfmt; do
        if ! cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1; then
            command -v rustup >/dev/null 2>&1 ||
                fail "cargo $component not found: install it with your Rust toolchain"
            rustup component add "$component" >/dev/null 2>&1 ||
                fail "cannot add cargo $component: run 'rustup component add $component'"
        fi
    done
fi

need=$(missing)
[[ -z $need ]] && exit 0

if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    echo "make $target: installing the Debian packages $need" >&2
    log=$(mktemp)
    # shellcheck disable=SC2086 # $need is a list of package names
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $need; } >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        fail "could not install $need with apt-get (its last lines above)"
    fi
    rm -f "$log"
    still=$(missing)
    [[ -z $still ]] || fail "installed $need, but still missing: $still"
    exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
    fail "missing the Debian packages $need: run 'sudo apt-get install -y $need', then make $target again"
fi
fail "missing system packages (Debian names): $need; install them, then run make $target again"
