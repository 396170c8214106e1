# Sourced at the start of every command on the lent GPU machines (no network there):
# installs the carried wheels (nox and its needs, see README) and records which commit runs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
[ -f .gitsha ] && export PACKBENCH_GIT_SHA=$(cat .gitsha) PACKBENCH_GIT_DIRTY=$(cat .gitdirty)
nvidia-smi -L
# For the call scripts: END is the call's deadline (10 min box less a margin for copying back);
# left prints the seconds to it; keep EXP copies an experiment's rows and point logs under $OUT,
# after every sweep, so a call cut short still brings back what ran.
END=$((SECONDS + ${CALL_S:-560}))
left() { echo $((END - SECONDS)); }
keep() { mkdir -p "$OUT/$1"; cp results/"$1"/*.jsonl "$OUT/$1/" 2>/dev/null; tar czf "$OUT/$1/logs.tgz" -C results/"$1" logs 2>/dev/null; true; }
# sweep_groups EXP MODEL T:variant[,variant...] ...: one sweep per group (its variants side by
# side in one run), in order, while the call has time; rows and logs kept after each.
# SWEEP_ARGS=--overwrite reruns points that already have rows (otherwise the sweep skips them).
sweep_groups() {
  local exp=$1 model=$2 name; shift 2
  name=$(basename "$exp" .toml)
  for g in "$@"; do
    [ $(left) -gt 100 ] || { echo "no time left for $g"; break; }
    PACKBENCH_STACKS_EVERY=90 timeout $(left) python3 -m harness sweep "$exp" --models "$model" --seq-lens ${g%%:*} \
      --variants $(echo ${g#*:} | tr , ' ') --timeout $(( $(left) - 10 )) --quiet --no-report $SWEEP_ARGS 2>&1 | tail -1
    keep "$name"
  done
}
