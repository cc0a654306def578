# Sourced by the GPU scripts: `stage NAME LIMIT_S LOG CMD...` runs CMD under its own time limit with its output in
# $OUT/LOG, prints the last $STAGE_TAIL (60) lines and its exit status, and is skipped unless NAME is in $STAGES. A
# stage that fails or times out is logged and the next one still runs.
stage() {
  local name=$1 limit=$2 log=$3 start=$SECONDS
  shift 3
  case " $STAGES " in *" $name "*) ;; *) echo "=== $name skipped (STAGES=$STAGES)"; return 0 ;; esac
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  tail -n "${STAGE_TAIL:-60}" "$OUT/$log"
  echo "=== $name rc=$rc $((SECONDS - start))s"
}
