#!/usr/bin/env bash
# The lock annotations checked by clang: part of the clang build (scripts/clang-build.sh).
exec "$(dirname "$0")/clang-build.sh" "$@"
