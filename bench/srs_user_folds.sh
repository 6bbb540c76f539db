#!/bin/bash
# Issue 38: one flashcard network trained across users, scored on users it never saw, in four folds over the sixteen
# users of ../shared/data/srs (each user scored once, by the model of the twelve others). Per fold: train with the
# defaults (intervals at most twice FSRS-6's), `nextstep evaluate` on the fold's four users, bench/srs_intervals.py
# on them, and the same with the network's own curve (no rule: re-exported, same weights). docs/results.md has the
# figures and the times; bench/srs_gap_sweep.py scores other rules on the same models.
#
#     bench/srs_user_folds.sh [DATA (../shared/data/srs)] [OUT (runs/user_folds)] [SEED (0)]
#
# SEED seeds the training; INTERVALS=0 in the environment skips the interval and no-rule passes (the log-loss
# figures only, for the extra seeds); EPOCHS caps the training epochs (5: a cap for this 2-core machine; 0: no cap,
# the training config's own, early stopping on each training user's latest reviews deciding). Then: python bench/srs_user_folds.py OUT [OUT ...]   (the tables; over seeds
# when given several)
set -euo pipefail
DATA=$(realpath "${1:-../shared/data/srs}")
OUT=$(realpath -m "${2:-runs/user_folds}")
SEED=${3:-0}
INTERVALS=${INTERVALS:-1}
EPOCHS=${EPOCHS:-5}
FOLDS=(  # balanced by reviews: each fold holds one of the four largest users
  "ankimath anki_more/tkilb_ebrain-tech anki_small/Peregrine42_anki-flashcards anki_more/khanhtranngoccva_MyAnkiFlashcards"
  "py_fsrs_josh anki_more/ASproson_anki anki_small/hbnordin2_anki_cards anki_more/tobenwarrior_Anki2"
  "anki_more/tooyond_anki_zikao anki_more/CasioWave_AnkiCollection anki_small/maxproft_Anki anki_more/Machtan_anki-flashcards"
  "anki_more/gmprojects-ctrl_myanki anki_more/TonioBanderas_Binga anki_more/superdrdood_kanji anki_small/yourchocobro_Anki-Collection-Dump"
)
BENCH=$(dirname "$(realpath "$0")")
mkdir -p "$OUT"
CAP=$([ "$EPOCHS" = 0 ] || echo '"max_epochs": '"$EPOCHS"', ')
echo '{"cross_validate": false, '"$CAP"'"seed": '"$SEED"', "threads": 1}' > "$OUT/cfg.json"
for k in 1 2 3 4; do  # each fold's users as links: its four to score, the twelve others to train on
  mkdir -p "$OUT/f$k/train" "$OUT/f$k/test"
  for j in 1 2 3 4; do
    for u in ${FOLDS[$((j - 1))]}; do
      side=$([ "$j" = "$k" ] && echo test || echo train)
      ln -sfn "$DATA/$u" "$OUT/f$k/$side/$(basename "$u")"
    done
  done
done
for k in 1 2 3 4; do
  F=$OUT/f$k
  [ -f "$F/model/manifest.json" ] || nextstep train time_aware --data "$F/train" --out "$F/model" --config "$OUT/cfg.json"
  [ -f "$F/eval_on.json" ] || nextstep evaluate "$F/model" --data "$F/test" --json "$F/eval_on.json"
  [ "$INTERVALS" = 1 ] || continue
  python "$BENCH/srs_intervals.py" "$F/model" --data "$F/test" --json "$F/int_on.json"
  python "$BENCH/srs_intervals.py" "$F/model" --data "$F/test" --json "$F/int_off.json" \
    --set gap_shrink=false interval_ratio_max=null --export-to "$F/model_off"
  nextstep evaluate "$F/model_off" --data "$F/test" --json "$F/eval_off.json"
done
