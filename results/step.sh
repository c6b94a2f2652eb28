# Sourced by the results/*/run.sh scripts from the repository root.
step() {  # step LOG cmd...: header (time, CPU, load, commit), the command, its output, its exit code
  local log=$1; shift
  { echo "# $(date -u +%FT%TZ) $(lscpu | grep 'Model name' | sed 's/  */ /g'); load: $(cut -d' ' -f1-3 /proc/loadavg); commit $(git rev-parse --short HEAD)"
    echo "\$ $*"; "$@" 2>/dev/null; echo "exit $?"; } > "$log"
}
checkout_at() {  # checkout_at COMMIT: prints a worktree of COMMIT beside this checkout (../sd-COMMIT, so that
  # ../shared is found there too), made on first use
  local dir; dir="$(pwd)/../sd-$1"
  [ -d "$dir" ] || git worktree add --detach -q "$dir" "$1"
  echo "$dir"
}
