#!/usr/bin/env bash
# Installs Debian's `chromium` for the console's browser tests (Playwright drives it via
# executable_path=/usr/bin/chromium; we never run `playwright install`). Idempotent:
# does nothing when /usr/bin/chromium is already there.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  echo "chromium already installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install_browser: need root (or sudo) to apt-get install chromium" >&2; exit 2
  fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-liberation >/dev/null
if [ ! -x /usr/bin/chromium ]; then
  echo "install_browser: apt-get finished but /usr/bin/chromium is missing" >&2
  exit 2
fi
echo "installed: $(/usr/bin/chromium --version 2>/dev/null || echo /usr/bin/chromium)"
