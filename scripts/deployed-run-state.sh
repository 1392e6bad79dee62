#!/usr/bin/env bash
# A stopped `python -m fedsd.deployment.deployed_distributed --work W --out O` run, carried to another
# machine or session: its public record, without what the next start makes again. The owners'
# private state is not in it: a resume needs W's state folders too, carried outside git.
#
#   scripts/deployed-run-state.sh save    W O DIR   # after the run is stopped (kill -TERM its pid)
#   scripts/deployed-run-state.sh restore W O DIR   # before the same command is run again (as root)
#
# DIR is for the repository (results/runs/...), so save keeps only what the owners would publish:
# DIR/owners/K: owner K's ledgers (ledger-*.json) and the plans it admitted (*/client-*-plan.json);
# DIR/roster: the owners' public keys; DIR/out: the run's folder (the server's checkpoint, records),
# without the per-round sums (secagg-sum-N.npy, 0.3 MB a round); DIR/rounds.jsonl: the rounds so
# far. An owner's identity key (identity.key), its train state (*/client-K.pt), its kept reply
# (*-last-reply.pt), its joined rounds and pinned task stay in W: a key in git is anyone's,
# so save refuses a DIR that would hold one. The owners' data is not kept: the command
# cuts the same shards again from the seed, and each ledger is named by a hash of its data's
# content: a restore over an owner's folder holding another ledger is refused, and after the first
# resumed round each owner's folder must still hold the saved ledger alone (`ls W/deployment/nodes/
# */state/ledger-*.json`: a second one would be a fresh budget for a different cut).
# Save only a stopped run: a ledger copied before the checkpoint it goes with would undercount.
# restore's file-name check is not the guard against rolling a ledger back: each owner's service
# keeps a record of what its state folder spent and joined outside it, in the owner's home
# (W/deployment/nodes/K/home/.local/state/fedsd, fedsd/privacy/owner_record.py), which neither
# save nor restore touches. Restored over a W whose run went on past DIR's rounds, an owner's folder
# is older than its record, and its service refuses to start, saying what the folder lacks and the
# ε charging on from it would spend again; `fedsd data-service --accept-restored-state` accepts it
# knowingly (the charges added back into its ledger, nothing spent twice). On a fresh W (another
# machine) there is no record to refuse it: a restore of the whole disk is beyond that defence.
set -euo pipefail
# copy SRC's contents into DST (made anew when `fresh`), leaving out the given tar patterns
copy() { src=$1 dst=$2 fresh=$3; shift 3
  [ "$fresh" = fresh ] && rm -rf "$dst"; mkdir -p "$dst"
  tar -C "$src" "${@/#/--exclude=}" -cf - . | tar -C "$dst" -xf -
}
IDENTITY=identity.key  # an owner's Ed25519 private key, 32 raw bytes (fedsd.secure.identity)
# an owner's public files in state folder SRC into DST (made anew): its ledgers and admitted plans
public() { src=$1 dst=$2
  rm -rf "$dst"; mkdir -p "$dst"
  (cd "$src" && find . -maxdepth 2 -type f \( -path './ledger-*.json' -o -path './*/client-*-plan.json' \) -print0) |
    tar -C "$src" --null -T - -cf - | tar -C "$dst" -xf -
}
# refuse (and delete) any private key under the given folders: an identity file, 32 bytes (they
# load as one), a PEM one
no_keys() { bad=$(find "$@" -type f \( -name "$IDENTITY" -o -size 32c \) -print
                  grep -rlE -- '-----BEGIN ([A-Z0-9]+ )*PRIVATE KEY-----' "$@" || true)
  [ -z "$bad" ] && return 0
  printf '%s\n' "$bad" | while IFS= read -r f; do rm -f -- "$f"; done
  echo "$0: a private key was about to be saved in $DIR (deleted; save none in the repository):" >&2
  printf '  %s\n' "$bad" >&2; exit 1
}
usage() { echo "usage: $0 save|restore W O DIR" >&2; exit 2; }
[ $# -eq 4 ] || usage
action=$1 W=$2 O=$3 DIR=$4
case $action in
  save)
    if pgrep -f -- "--work $W( |$)" >/dev/null; then
      echo "$0: a run on $W is still going: stop it first (kill -TERM its pid)" >&2; exit 1
    fi
    [ -d "$W/deployment/nodes" ] && [ -d "$O" ] || { echo "$0: no run in $W / $O" >&2; exit 1; }
    mkdir -p "$DIR/owners" "$DIR/out"
    for state in "$W"/deployment/nodes/*/state; do
      k=$(basename "$(dirname "$state")")
      public "$state" "$DIR/owners/$k"
    done
    rm -f "$DIR/roster"
    [ -f "$W/deployment/shared/roster" ] && cp "$W/deployment/shared/roster" "$DIR/roster"
    copy "$O" "$DIR/out" fresh 'secagg-sum-*.npy' "$IDENTITY" '*.key' '*.pem'
    cp "$W/rounds.jsonl" "$DIR/rounds.jsonl"
    no_keys "$DIR/owners" "$DIR/out"
    chown -R "$(id -u):$(id -g)" "$DIR"
    echo "saved: $(tail -n 1 "$DIR/rounds.jsonl" | cut -c1-80)"
    ;;
  restore)
    [ -d "$DIR/owners" ] && [ -d "$DIR/out" ] || { echo "$0: no saved run in $DIR" >&2; exit 1; }
    for saved in "$DIR"/owners/*; do
      k=$(basename "$saved")
      state=$W/deployment/nodes/$k/state
      if [ -d "$state" ] && ls "$state"/ledger-*.json >/dev/null 2>&1; then
        for ledger in "$state"/ledger-*.json; do
          [ -f "$saved/$(basename "$ledger")" ] || { echo "$0: owner $k's ledger $(basename "$ledger") is not the saved one" >&2; exit 1; }
        done
      fi
      mkdir -p "$state"
      copy "$saved" "$state" keep
      chmod -R go-rwx "$state"  # git keeps no 0600: the service refuses a state file others can read
      # the owner's record (outside the folder) is left as it is: a folder older than it is refused at start
      record=$W/deployment/nodes/$k/home/.local/state/fedsd
      if [ -d "$record" ]; then
        echo "owner $k: its record in $record stays; its service refuses this folder if it is older" \
          "(fedsd data-service --accept-restored-state accepts it knowingly)"
      fi
    done
    mkdir -p "$O"
    copy "$DIR/out" "$O" keep
    cp "$DIR/rounds.jsonl" "$W/rounds.jsonl"
    echo "restored: $(tail -n 1 "$W/rounds.jsonl" | cut -c1-80); run the same command again to resume"
    ;;
  *) usage ;;
esac
