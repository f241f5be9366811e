#!/usr/bin/env bash
# Debian's Chromium for the browser tests (pytest -m browser), never a browser download.
# Installs it with apt when it is missing and this runs as root with apt-get (CI, containers);
# otherwise says why the browser tests will be skipped. Never fails the build.
set -uo pipefail
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "browser tests will be skipped: chromium is missing and installing it needs root" \
         "(sudo apt-get install chromium)" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "browser tests will be skipped: chromium is missing and there is no apt-get here" >&2
    exit 0
fi
echo "installing Debian's chromium for the browser tests (apt-get) ..." >&2
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/tmp/overlapkit-apt.log 2>&1; then
    apt-get update -q >>/tmp/overlapkit-apt.log 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >>/tmp/overlapkit-apt.log 2>&1 ||
        echo "browser tests will be skipped: apt-get could not install chromium" \
             "(see /tmp/overlapkit-apt.log)" >&2
fi
exit 0
