#!/usr/bin/env bash
# The relay (written by `spill example relay`): build a project uninterrupted as the reference;
# build it again, stop inside tune, move the run with `spill move` to a second place with its own
# SPILL_HOME (a second machine: here another engine, or an S3 store), finish it there, and check
# the result against the reference within the measured noise floor (noise-floor.json).
#
#   ./relay.sh                      both legs on this machine, leg b on the other engine
#   ./relay.sh --s3 s3://bucket/p   move to an S3 store (AWS_* settings as for `spill move`)
#   ./relay.sh --two-machines       leg a here; prints what to copy and run on a second machine
#   ./relay.sh --finish             leg b and the checks (run on the second machine)
#   --from ENGINE --to ENGINE --stop N   override the settings below
#   --project NAME                 accepted when NAME is this folder's project
#
# Exits 0 when every check passed, 1 when one failed, the failing command's code otherwise.
set -euo pipefail

PROJECT=@PROJECT@  # the project folder's name (its copy is ./project)
FROM=@FROM@  # leg a's engine
TO=@TO@  # leg b's engine
STOP=@STOP@  # leg a stops after this many tune steps (where noise-floor.json measured moves)

HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="$HERE/work"
SPILL="${SPILL:-spill}"
DEST="" TWO=0 FINISH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --s3) DEST="$2"; shift 2 ;;
    --from) FROM="$2"; shift 2 ;;
    --to) TO="$2"; shift 2 ;;
    --stop) STOP="$2"; shift 2 ;;
    --project)
      if [ "$2" != "$PROJECT" ]; then
        echo "relay.sh: this folder relays $PROJECT; \`spill example relay DIR --project $2\` writes one for $2" >&2
        exit 2
      fi
      shift 2 ;;
    --two-machines) TWO=1; shift ;;
    --finish) FINISH=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "relay.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
REF="$WORK/reference"
RELAY="$WORK/relay"
if [ -f "$WORK/destination" ]; then DEST="${DEST:-$(cat "$WORK/destination")}"; fi
DEST="${DEST:-$WORK/relay-moved}"

say() { printf '\n== %s\n' "$*"; }

leg_a() {
  export SPILL_HOME="$WORK/home-a"
  if [ "$FROM" = "$TO" ]; then
    echo "relay.sh: leg b computes on $TO too (no second engine here): the relay hands the run" \
      "between two places and two SPILL_HOMEs, and the checks say so" >&2
  fi
  say "leg a: the reference, uninterrupted ($PROJECT on $FROM)"
  rm -rf "$WORK"
  mkdir -p "$WORK"
  cp -r "$HERE/project" "$REF"
  "$SPILL" build "$REF" --engine "$FROM"
  "$SPILL" status "$REF" --json > "$WORK/reference.json"
  say "leg a: the relay, stopped after tune step $STOP"
  cp -r "$HERE/project" "$RELAY"
  "$SPILL" build "$RELAY" --engine "$FROM" --stop-after "tune:$STOP"
  "$SPILL" example relay-leg a --engine "$FROM" --legs "$WORK/legs.json"
  say "leg a: move the run to $DEST"
  "$SPILL" move "$RELAY" "$DEST"
  echo "$DEST" > "$WORK/destination"
}

leg_b() {
  export SPILL_HOME="$WORK/home-b"
  say "leg b: finish the moved build at $DEST on $TO"
  "$SPILL" build "$DEST" --engine "$TO"
  "$SPILL" example relay-leg b --engine "$TO" --legs "$WORK/legs.json"
  say "checks"
  "$SPILL" example relay-check --reference "$WORK/reference.json" --relay "$DEST" \
    --legs "$WORK/legs.json" --noise-floor "$HERE/noise-floor.json" --stop "$STOP"
}

if [ "$FINISH" = 1 ]; then leg_b; exit $?; fi
leg_a
if [ "$TWO" = 1 ]; then
  say "leg a is done on $(uname -n). On the second machine:"
  case "$DEST" in
    *://*) echo "  1. copy this folder without work/home-a: rsync -a --exclude work/home-a $HERE/ OTHER:$HERE/" ;;
    *) echo "  1. copy this folder to the same path there: rsync -a --exclude work/home-a $HERE/ OTHER:$HERE/"
       echo "     (the moved run lives at $DEST; or rerun with --s3 URI to hand over through a store)" ;;
  esac
  echo "  2. install spill there (the same version: $("$SPILL" --version)) with the $TO engine"
  echo "  3. run: $HERE/relay.sh --finish --to $TO"
  echo "     it finishes the build there with its own SPILL_HOME and runs the same checks"
  exit 0
fi
leg_b
