#!/usr/bin/env bash
# The one line that says how a job ended, from its log: what launch.sh's tmux pane prints last, so the tail of
# `tmux capture-pane` answers "did it finish, stop, or die, and why" without scrolling back.
#   bash tools/job_outcome.sh LOG [FIRST_LINE]     (FIRST_LINE: where this run's output starts; the log is appended)
# The first ABORT line (the watchdog's reason; each surviving rank prints one), else the last of done: / stopped at
# step / error: / DRY_RUN:; torchrun's [rankN]: prefix is dropped.
log=$1 from=${2:-1}
run=$(tail -n +"$from" "$log" 2>/dev/null | tr '\r' '\n')
line=$(grep -a -m1 -E "ABORT: " <<< "$run")
[ -n "$line" ] || line=$(grep -a -E "^(\[rank[0-9]+\]:)?(done: |stopped at step |error: |DRY_RUN: )" <<< "$run" | tail -1)
line=$(sed -E 's/^\[rank[0-9]+\]://' <<< "$line")
echo "${line:-no outcome line in $log: see its last lines}"
