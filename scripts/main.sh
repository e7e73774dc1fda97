#!/usr/bin/env bash
# Main job: set up, print what this machine has, then run the conformance suite on every
# device present (reports under reports/<device>.json and .md). Exit status is non-zero if any case fails.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PK=.venv/bin/portakern
$PK info
mkdir -p reports
status=0
# every device the conformance runner can place inputs on (cpu, cuda, rocm); a failure to list them
# must stop the job (a command substitution in a for list would hide it and exit 0 having run nothing)
devices=$(.venv/bin/python -c "import portakern; print(' '.join(str(d) for d in portakern.devices() if d.type in ('cpu', 'cuda', 'rocm')))") \
  || { echo "main.sh: listing the devices failed (see above); no conformance run was possible" >&2; exit 1; }
if [ -z "$devices" ]; then
  echo "main.sh: portakern lists no cpu, cuda or rocm device; no conformance run was possible" >&2
  exit 1
fi
# the cpu tier on the CPU; on a GPU the gpu tier, which holds every cpu-tier case plus production
# shapes. --jobs 0: one worker per core (kernel compilation dominates a run); progress goes to stderr.
for dev in $devices; do
  tier=cpu; [ "$dev" != cpu ] && tier=gpu
  name=${dev//:/-}
  echo "== conformance on $dev, tier $tier =="
  $PK conformance --device "$dev" --tier "$tier" --jobs 0 \
    --report "reports/$name.json" --markdown "reports/$name.md" || status=1
done
exit $status
