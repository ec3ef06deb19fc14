# Sourced by the lent-machine scripts (bench/gpu_8b.sh, bench/tpu_8b.sh, probes/gpu_writes.sh,
# probes/gpu_conformance.sh, probes/gpu_nvfp4.sh, probes/cpu_conformance.sh) with NAME set: sets REPO, PY, OUT and a
# temporary WORK folder (removed on exit), and exposes the repository root, which is the fp8kv
# package, under that name without installing it.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$( [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || command -v python3 )}"
OUT="${OUT:-$REPO/bench/results}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fp8kv-$NAME-XXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/path" "$OUT" && ln -s "$REPO" "$WORK/path/fp8kv"
export PYTHONPATH="$WORK/path${PYTHONPATH:+:$PYTHONPATH}"

# A script that needs a CUDA GPU calls this first: on a machine without one it says so in one line and exits 4
# (the probes' "cannot run here"), before anything else is asked of the machine.
needs_cuda() {
    "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 4)" 2>/dev/null \
        || { echo "$NAME: needs a CUDA GPU, and torch in $PY sees none here; nothing run"; exit 4; }
}
