# Sourced by the one-call GPU scripts (vllm_side_by_side.sh, kernel_ab.sh): runs their steps
# under one time budget. The caller sets out (the log folder), budget (seconds for all steps)
# and t_all (the start, $(date +%s)).
#
#   step NAME TIMEOUT_S [ENV=VALUE ...] -- COMMAND...
#
# runs COMMAND (with the ENV assignments) as its own process under `timeout`, its output in
# $out/NAME.log; a step that would start with less than 30 s of the budget left is skipped, and
# a running one is cut where the budget ends. A failed step's last lines are printed; the next
# step runs anyway.
step() {
  local name=$1 limit=$2 envs=() t0 rc left
  shift 2
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  t0=$(date +%s)
  left=$((budget - (t0 - t_all)))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped (${left} s left of BUDGET_S=$budget)" >&2
    return 0
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name: $*" >&2
  timeout "$limit" env "${envs[@]}" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "   $name: rc=$rc, $(($(date +%s) - t0)) s (total $(($(date +%s) - t_all)) s)" >&2
  [ $rc -eq 0 ] || tail -n 15 "$out/$name.log" >&2
}
