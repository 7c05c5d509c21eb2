#!/usr/bin/env bash
# No comment cites a file that is not in the repo. Every path ending in .md (with at least one folder)
# named in a source file (C++, CUDA, proto, CMake, shell, Python) must exist relative to the repository
# root, and every link into docs/ that a Markdown file of the repo makes must exist there. Paths outside the repo
# (an absolute /work/... path, a design note kept elsewhere) fail too: a reader of the tree cannot open them.
# Markdown files cite other projects' files as well (transformers' own model docs, say), so only their
# links into our own docs/ are checked.
set -u
root=${1:?usage: check_doc_refs.sh SOURCE_DIR}
cd "$root" || exit 2
fail=0
report() {  # report FILE:LINE CITED
  echo "doc refs: $1 cites $2, which is not in the repo"
  fail=1
}
# Source files: any path with a slash that ends in .md.
while IFS=: read -r file line text; do
  for ref in $(grep -oE '(/?[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.md\b' <<<"$text"); do
    if [[ $ref == /* ]] || [ ! -f "$ref" ]; then report "$file:$line" "$ref"; fi
  done
done < <(git ls-files -z --cached --others --exclude-standard -- '*.h' '*.cc' '*.cu' '*.cuh' '*.proto' '*.cmake' '*CMakeLists.txt' '*.sh' '*.py' \
           ':!tests/data' | xargs -0 grep -nE '[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+\.md\b' /dev/null)
# Markdown files: links into our docs/.
while IFS=: read -r file line text; do
  for ref in $(grep -oE '(^|[^A-Za-z0-9_./-])docs/[A-Za-z0-9_.-]+\.md\b' <<<"$text" | grep -oE 'docs/.*'); do
    [ -f "$ref" ] || report "$file:$line" "$ref"
  done
done < <(git ls-files -z --cached --others --exclude-standard -- '*.md' | xargs -0 grep -nE 'docs/[A-Za-z0-9_.-]+\.md\b' /dev/null)
if [ $fail -ne 0 ]; then
  echo "1 failed: fix each citation above (point it at a file in the repo, or drop it)"
  exit 1
fi
echo "doc refs: every cited .md file is in the repo"
