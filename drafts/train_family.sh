#!/usr/bin/env bash
# Trains a draft family (issue 20): one recipe and one budget for every draft of the family, only
# the shape varies. The family's folder holds grid.sh, which sets
#   target   the target alias;
#   width    width name -> `specdraft design build` width flags (empty: the target's width);
#   grid     draft names d<depth>-<width>-h<16k|full>, cheapest first (h16k: a 16384-token head,
#            hfull: the whole vocabulary);
#   recipe   the data and training flags every draft of the family shares.
# A depth-d draft starts from target layers 0..d-1. A rerun resumes each draft from its work
# directory and skips the finished ones.
#   usage: drafts/train_family.sh drafts/smollm2-135m-family [WORK_ROOT]   (default /tmp/specdraft-family)
set -euo pipefail
family=${1:?usage: drafts/train_family.sh FAMILY_DIR [WORK_ROOT]}
work=${2:-/tmp/specdraft-family}/$(basename "$family")
declare -A width
# shellcheck source=/dev/null
source "$family/grid.sh"
for name in $grid; do
    [[ -f $family/$name/specdraft.json ]] && continue
    IFS=- read -r d w h <<<"$name"
    head=$([[ $h == hfull ]] && echo 0 || echo 16384)
    # shellcheck disable=SC2086
    specdraft design build --target "$target" --kind layers --layers "$(seq -s, 0 $((${d#d} - 1)))" \
        ${width[$w]} --head "$head" $recipe --work "$work/$name.work" --out "$family/$name"
done
