#!/usr/bin/env bash
# Screenshots of the built documentation site, as a browser shows it: docs/screenshots/front.png (the home page)
# and docs/screenshots/api-ops.png (the fused ops' API reference). Needs Chromium (Debian: apt-get install chromium)
# and the docs extra. Not part of CI: the tests build the site strictly; these pictures are for reviewers.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site"
port=8765
.venv/bin/python -m http.server "$port" --bind 127.0.0.1 --directory "$site" > /dev/null 2>&1 &
server=$!
trap 'kill $server' EXIT
sleep 1
# The flags keep headless Chromium off the network it cannot reach here (background updates, sync).
for page in "index.html front" "reference/ops/index.html api-ops"; do
    set -- $page
    chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
        --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --hide-scrollbars \
        --window-size=1280,900 --screenshot="docs/screenshots/$2.png" "http://127.0.0.1:$port/$1"
done
