#!/bin/sh
# Before (main) and after (this branch) in one run, alternating: ./compare.sh BEFORE AFTER [ROUNDS]
here=$(cd "$(dirname "$0")" && pwd)
for round in $(seq "${3:-3}"); do
  for mode in global thread_local relaxed; do
    for tree in "$1" "$2"; do PYTHONPATH="$tree:$here" python3 "$here/probe.py" "$mode"; done
  done
done
