# Sourced at the start of every command on the lent GPU machines (no network there):
# installs the carried wheels (nox and its needs, see README) and records which commit runs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
[ -f .gitsha ] && export PACKBENCH_GIT_SHA=$(cat .gitsha) PACKBENCH_GIT_DIRTY=$(cat .gitdirty)
nvidia-smi -L
