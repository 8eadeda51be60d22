#!/usr/bin/env bash
# Write the package of an earlier commit to .base/ (attnfuse/ and attnfuse_plugins/), with this tree's
# attnfuse/bench copied in (the benchmark code, whichever commit the kernels come from), for
# `scripts/gpu_session.sh bench_base`: before/after benchmarks in one device call.   bash scripts/base_tree.sh REV
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .base && mkdir -p .base
git archive "${1:?a commit}" attnfuse plugins | tar -x -C .base
mv .base/plugins .base/attnfuse_plugins
rm -rf .base/attnfuse/bench && cp -r attnfuse/bench .base/attnfuse/bench && rm -rf .base/attnfuse/bench/__pycache__
# modules the benchmark code imports that an older tree may lack
for module in rotary.py; do [ -e ".base/attnfuse/$module" ] || cp "attnfuse/$module" ".base/attnfuse/$module"; done
