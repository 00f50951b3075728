#!/usr/bin/env bash
# Probe a real NVIDIA GPU host with herd's NVML backend and record what it sees.
#   bench/nvml_probe.sh [OUTDIR]        (default OUTDIR: $OUT or /tmp/herd-nvml-probe)
# Writes: nvidia-smi.txt, nvidia-smi-topo.txt (for comparison), gpus.json (herd gpus --gpus nvml --json),
# gpus.txt (the table + topology matrix), probe.json (~5 s of the monitor: poll + event loop, health
# changes, statistics incl. poll_ms), bench.json (python -m bench.gpus --json, incl. the real NVML poll).
# Needs: python 3.11 with trio, msgspec, psutil, nvidia-ml-py, httpx (the repo's .venv if present).
set -u
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-/tmp/herd-nvml-probe}}
mkdir -p "$OUTDIR"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECS=${PROBE_SECONDS:-5}

(nvidia-smi; nvidia-smi -q -d TEMPERATURE,ECC,PERFORMANCE | head -200) > "$OUTDIR/nvidia-smi.txt" 2>&1 || true
nvidia-smi topo -m > "$OUTDIR/nvidia-smi-topo.txt" 2>&1 || true

timeout 120 "$PY" -m cli.main gpus --gpus nvml --json > "$OUTDIR/gpus.json" 2> "$OUTDIR/gpus.err"
echo "herd gpus --gpus nvml --json: rc=$? ($(wc -c < "$OUTDIR/gpus.json") bytes)"
timeout 120 "$PY" -m cli.main gpus --gpus nvml > "$OUTDIR/gpus.txt" 2>&1
echo "herd gpus --gpus nvml: rc=$?"
timeout $((SECS + 120)) "$PY" -m agent.gpus.probe --gpus nvml --seconds "$SECS" \
    > "$OUTDIR/probe.json" 2> "$OUTDIR/probe.err"
echo "probe (${SECS}s of the event loop): rc=$?"
timeout 300 "$PY" -m bench.gpus --json --polls 200 --seconds 3 > "$OUTDIR/bench.json" 2> "$OUTDIR/bench.err"
echo "bench.gpus: rc=$?"
cat "$OUTDIR/gpus.txt"
"$PY" - "$OUTDIR" <<'PYEOF'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
try:
    p = json.loads((d / "probe.json").read_text())
    st = p.get("statistics", {})
    print("probe:", {k: st.get(k) for k in ("gpus", "polls", "poll_ms_p50", "poll_ms_max", "events", "xids",
                                             "kmsg_xids", "poll_timeouts", "health")}, "error:", p.get("error"))
    b = json.loads((d / "bench.json").read_text())
    print("real nvml poll:", b.get("nvml_real_poll"))
except Exception as e:  # a summary only: the files above are the record
    print("summary failed:", e)
PYEOF
