#!/usr/bin/env bash
# Write the package of an earlier commit to .base/ (attnfuse/ and attnfuse_plugins/), for
# `scripts/gpu_session.sh bench_base`: before/after benchmarks in one device call.   bash scripts/base_tree.sh REV
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .base && mkdir -p .base
git archive "${1:?a commit}" attnfuse plugins | tar -x -C .base
mv .base/plugins .base/attnfuse_plugins
