#!/usr/bin/env bash
# deploy/install-deps.sh checks what is missing before it asks for root. Runs the script with stub
# dpkg-query / id / apt-get on PATH (nothing is installed, nothing needs root) and checks:
#   1. everything installed, not root: exit 0 without touching apt-get;
#   2. two packages missing, not root: exit 1, the exact apt-get line naming just those two, no apt-get run;
#   3. two packages missing, root: apt-get install runs for just those two.
set -u
script=${1:?usage: install_deps_test.sh PATH/TO/install-deps.sh}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir "$tmp/bin"
# dpkg-query -W -f=... PKG: installed unless PKG is listed in $STUB_MISSING.
cat > "$tmp/bin/dpkg-query" <<'STUB'
#!/usr/bin/env bash
pkg=${!#}
for m in $STUB_MISSING; do [ "$m" = "$pkg" ] && exit 1; done
printf 'install ok installed'
STUB
printf '#!/usr/bin/env bash\necho "$STUB_UID"\n' > "$tmp/bin/id"
printf '#!/usr/bin/env bash\necho "apt-get $*" >> "$STUB_LOG"\n' > "$tmp/bin/apt-get"
chmod +x "$tmp/bin/"*
fail=0
run() {  # run UID MISSING: sets rc, out (stdout+stderr), calls (the apt-get calls)
  : > "$tmp/log"
  out=$(PATH="$tmp/bin:$PATH" STUB_UID=$1 STUB_MISSING=$2 STUB_LOG="$tmp/log" bash "$script" 2>&1)
  rc=$?
  calls=$(cat "$tmp/log")
}
expect() {  # expect WHAT CONDITION...
  local what=$1; shift
  if ! "$@"; then
    echo "FAIL: $what"; echo "  rc=$rc"; echo "  output: $out"; echo "  apt-get calls: $calls"; fail=1
  fi
}
contains() { [[ $1 == *"$2"* ]]; }

run 1000 ""
expect "all installed, not root: exit 0" test "$rc" -eq 0
expect "all installed: says so" contains "$out" "already installed"
expect "all installed: no apt-get" test -z "$calls"

run 1000 "libgtest-dev numactl"
expect "missing, not root: exit 1" test "$rc" -eq 1
expect "missing, not root: the exact apt-get line" \
  contains "$out" "apt-get update && apt-get install -y --no-install-recommends libgtest-dev numactl"
expect "missing, not root: no apt-get run" test -z "$calls"

run 0 "libgtest-dev numactl"
expect "missing, root: exit 0" test "$rc" -eq 0
expect "missing, root: installs just the missing ones" \
  contains "$calls" "install -y -qq --no-install-recommends libgtest-dev numactl"

[ $fail -eq 0 ] && echo "install-deps.sh: checks before asking for root"
exit $fail
