#!/usr/bin/env bash
# Product output names no issue numbers: every binary's --help, and every subcommand's of `numoe` and
# `numoe-bench` (read from the "commands:" / "benchmarks:" listing of their --help, so a new subcommand
# is checked without editing this), must exit 0, print something, and contain no "#<digits>" or "issue".
set -u
bin=${1:?usage: check_help_text.sh BIN_DIR}
fail=0
check() {  # check ARGV...: runs it and checks its output
  local out rc
  out=$("$bin/$1" "${@:2}" 2>&1)
  rc=$?
  if [ $rc -ne 0 ] || [ -z "$out" ]; then
    echo "help text: '$*' exited $rc with ${#out} bytes of output"; fail=1; return
  fi
  local hits
  hits=$(grep -nE -i '#[0-9]+|\bissues?\b' <<<"$out")
  if [ -n "$hits" ]; then
    echo "help text: '$*' names an issue:"; echo "$hits" | sed 's/^/  /'; fail=1
  fi
}
subcommands() {  # the names listed under "commands:" in `$1 --help`
  "$bin/$1" --help 2>&1 | awk '/^(commands|benchmarks):/{on=1; next} on && /^  [a-z]/{print $1}'
}
for b in numoe numoe-bench numoe-gpu numoe-worker numoe-router; do
  check "$b" --help
done
for tool in numoe numoe-bench; do
  subs=$(subcommands "$tool")
  [ -n "$subs" ] || { echo "help text: '$tool --help' lists no commands"; fail=1; }
  for s in $subs; do check "$tool" "$s" --help; done
done
[ $fail -eq 0 ] && echo "help text: no issue numbers in any --help"
exit $fail
