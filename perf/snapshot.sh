#!/usr/bin/env bash
# An earlier commit's engine beside today's benchmark scripts, for an A/B across commits in one
# device call (the machines are too noisy to compare calls):
#   bash perf/snapshot.sh 0142581     # writes .snapshot/ (ignored): carry it to the device
#   bash perf/run_gpu.sh w4old ...    # runs today's perf/ scripts against that engine
# .snapshot/ holds pagedbackend/ and model_repository/ at <commit>, copies of today's perf/ and
# client/ (the load generators stay the same on both sides) and COMMIT. Only scripts that use
# no A/B switch (--ab) run against an older engine.
set -eu
cd "$(dirname "$0")/.."
rev=$(git rev-parse --verify "${1:?usage: perf/snapshot.sh <commit>}^{commit}")
rm -rf .snapshot && mkdir .snapshot
git archive "$rev" pagedbackend model_repository | tar -x -C .snapshot
cp -r perf client .snapshot/ && rm -rf .snapshot/perf/results .snapshot/perf/logs
mkdir .snapshot/perf/results
echo "$rev" > .snapshot/COMMIT
echo ".snapshot: $(git log -1 --format='%h %s' "$rev" | cut -c1-100)"
