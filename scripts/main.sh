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
# every device the conformance runner can place inputs on (cpu, cuda, rocm, opencl), each with its tier: the cpu
# tier on the CPU and on OpenCL CPU devices (PoCL), the gpu tier (every cpu-tier case plus production shapes) on
# GPUs. A failure to list them must stop the job (a command substitution in a for list would hide it and exit 0
# having run nothing).
devices=$(.venv/bin/python -c "
import portakern
def tier(d):
    kind = dict(getattr(d, 'info', ()) or ()).get('device_type', 'gpu')
    return 'cpu' if d.type == 'cpu' or (d.type == 'opencl' and kind == 'cpu') else 'gpu'
print(' '.join(f'{d}={tier(d)}' for d in portakern.devices() if d.type in ('cpu', 'cuda', 'rocm', 'opencl')))") \
  || { echo "main.sh: listing the devices failed (see above); no conformance run was possible" >&2; exit 1; }
if [ -z "$devices" ]; then
  echo "main.sh: portakern lists no cpu, cuda, rocm or opencl device; no conformance run was possible" >&2
  exit 1
fi
# --jobs 0: one worker per core (kernel compilation dominates a run); progress goes to stderr.
for entry in $devices; do
  dev=${entry%=*}
  tier=${entry##*=}
  name=${dev//:/-}
  echo "== conformance on $dev, tier $tier =="
  $PK conformance --device "$dev" --tier "$tier" --jobs 0 \
    --report "reports/$name.json" --markdown "reports/$name.md" || status=1
done
exit $status
