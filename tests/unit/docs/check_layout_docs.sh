#!/usr/bin/env bash
# The Layout sections match the tree: docs/design.md ("## Layout", the fenced block: a top-level folder
# at the start of a line, its subfolders indented by two spaces under it) and README.md ("## Layout", the
# table's `folder/` rows). Every top-level folder of the repo appears in both, and every folder they
# list exists.
set -u
root=${1:?usage: check_layout_docs.sh SOURCE_DIR}
cd "$root" || exit 2
fail=0
# Top-level folders that hold tracked (or new, not ignored) files; hidden ones (.ci) are tooling.
tree=$(git ls-files --cached --others --exclude-standard | grep / | cut -d/ -f1 | grep -v '^\.' | sort -u)

# design.md: the first fenced block after "## Layout".
block=$(awk '/^## Layout/{on=1; next} on && /^```/{n++; if (n==2) exit; next} on && n==1' docs/design.md)
[ -n "$block" ] || { echo "layout docs: docs/design.md has no fenced block under '## Layout'"; exit 1; }
design_top=$(grep -oE '^[a-z_]+/' <<<"$block" | tr -d / | sort -u)
top=""
while IFS= read -r line; do
  if [[ $line =~ ^([a-z_]+)/ ]]; then
    top=${BASH_REMATCH[1]}
  elif [[ $line =~ ^\ \ ([a-z_0-9]+)/ ]]; then
    sub="$top/${BASH_REMATCH[1]}"
    [ -d "$sub" ] || { echo "layout docs: docs/design.md lists $sub/, which is not in the tree"; fail=1; }
  fi
done <<<"$block"
# README.md: rows "| `folder/` | ... |" of the table under "## Layout".
readme_top=$(awk '/^## Layout/{on=1; next} on && /^## /{exit} on' README.md |
             grep -oE '^\| `[a-z_]+/`' | grep -oE '[a-z_]+' | sort -u)

for doc in design readme; do
  listed=$([ $doc = design ] && echo "$design_top" || echo "$readme_top")
  name=$([ $doc = design ] && echo docs/design.md || echo README.md)
  for d in $tree; do
    grep -qx "$d" <<<"$listed" || { echo "layout docs: $name does not list $d/ (a folder of the tree)"; fail=1; }
  done
  for d in $listed; do
    [ -d "$d" ] || { echo "layout docs: $name lists $d/, which is not in the tree"; fail=1; }
  done
done
if [ $fail -ne 0 ]; then
  echo "1 failed: update the Layout sections above to match the tree"
  exit 1
fi
echo "layout docs: docs/design.md and README.md list the tree's folders"
