#!/usr/bin/env bash
# The dependency rule of docs/design.md ("Dependency rule"), checked on every #include of the tree:
#   common <- model <- {backends/*, worker, gpu_service}; router, cli, deploy and bench sit on top.
#   common/      includes only common/
#   model/       includes only common/ and model/
#   backends/    includes no worker/, gpu_service/ or router/ header
#   worker/      includes no gpu_service/ or router/ header
#   gpu_service/ includes no worker/ or router/ header
# The CMake targets follow the same rule (worker links numoe_model_api, never numoe_gpu_service), so a
# violation that slipped past this check would also fail to link; this names the line.
set -u
root=${1:?usage: check_layering.sh SOURCE_DIR}
cd "$root" || exit 2
fail=0
check() {  # check DIR PATTERN WHAT: no file under DIR may include a header matching PATTERN
  local dir=$1 pattern=$2 what=$3 hits
  hits=$(grep -rnE --include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh' \
         "^[[:space:]]*#[[:space:]]*include[[:space:]]+\"($pattern)/" "$dir" 2>/dev/null)
  if [ -n "$hits" ]; then
    echo "layering: $dir/ must not include $what:"
    echo "$hits" | sed 's/^/  /'
    fail=1
  fi
}
check common 'model|backends|worker|gpu_service|router|cli|deploy|bench|tests' 'anything above common/'
check model 'backends|worker|gpu_service|router|cli|deploy|bench|tests' 'anything but common/ and model/'
check backends 'worker|gpu_service|router|cli|deploy|bench|tests' 'worker/, gpu_service/, router/ or tools'
check worker 'gpu_service|router|cli|deploy|bench|tests' 'gpu_service/ (or router/, tools)'
check gpu_service 'worker|router|cli|deploy|bench|tests' 'worker/ (or router/, tools)'
if [ $fail -ne 0 ]; then
  echo "1 failed: the dependency rule is broken (see above)"
  exit 1
fi
echo "layering: common <- model <- {backends, worker, gpu_service} holds"
