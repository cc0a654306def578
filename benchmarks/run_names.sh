# Sourced by the benchmark scripts. free_run_name LOG_DIR RUN_DIR NAME prints NAME, or NAME-1, NAME-2, ... (the
# suffix rule of gpt2.observe.run_logging.make_run_dir): the first for which neither LOG_DIR/<it>.log nor RUN_DIR/<it>
# exists. Passing it as --run-name gives the run folder exactly that name, so a rerun writes a new log next to
# a new run folder instead of truncating the earlier run's log.
free_run_name() {
  local log_dir=$1 run_dir=$2 name=$3 candidate=$3 n=1
  while [ -e "$log_dir/$candidate.log" ] || [ -e "$run_dir/$candidate" ]; do
    candidate="$name-$n"
    n=$((n + 1))
  done
  printf '%s\n' "$candidate"
}
