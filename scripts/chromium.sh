#!/usr/bin/env bash
# Debian's chromium for the browser tests (tests/test_browser.py), installed where this machine allows it: as root,
# or with passwordless sudo, through apt-get. Elsewhere it prints one line: which tests will skip and how to get them.
# Called by scripts/test.sh and .ci/run; a no-op when chromium is there (PAPO_NB_CHROMIUM, default /usr/bin/chromium).
# CHROMIUM_INSTALL=0 never installs. With CI set, a failed install fails (the browser tests must run there).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
binary="${PAPO_NB_CHROMIUM:-/usr/bin/chromium}"
[[ -x "$binary" ]] && exit 0

count="$(grep -c '^def test_' tests/test_browser.py || true)"
skip_line() {
    echo "==> chromium: $1; the $count browser tests in tests/test_browser.py will skip (get them: sudo apt-get" \
        "install -y chromium, or PAPO_NB_CHROMIUM=/path/to/chromium)"
}

sudo=()
if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(none); fi
fi
if [[ "${CHROMIUM_INSTALL:-1}" == "0" ]]; then
    skip_line "not at $binary and CHROMIUM_INSTALL=0"
    exit 0
fi
if [[ "${sudo[*]}" == "none" ]] || ! command -v apt-get >/dev/null; then
    skip_line "not at $binary, and this machine cannot install it here (needs root or passwordless sudo, and apt-get)"
    exit 0
fi

start=$SECONDS
echo "==> apt-get update && apt-get install -y chromium"
if "${sudo[@]}" apt-get update -q && "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; then
    echo "==> chromium install wall time: $((SECONDS - start)) s"
    exit 0
fi
skip_line "apt-get could not install it"
if [[ -n "${CI:-}" && "${CI,,}" != "false" && "${CI}" != "0" ]]; then exit 1; fi
exit 0
