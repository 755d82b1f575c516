#!/usr/bin/env bash
# Opens N partitions (default 10,000) on one standalone broker and prints how long they
# took to open and accept produce, the descriptors the process holds and its resident
# memory per partition.
# Usage: scripts/many_partitions.sh [N]
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-10000}"
MANY_PARTITIONS_COUNT="$n" cargo test --test many_partitions \
  thousands_of_partitions_open_with_about_one_descriptor_each -- --nocapture 2>&1 \
  | grep -E "partitions:|test result|panicked|descriptors|resident"
