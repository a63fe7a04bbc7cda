"""The trainer's library, what train_dflash.py drives: its settings (settings), main's phases from the role setup
to the feed (phases), the transport between the roles (pipe) and the watchdog that ends a job on a dead or stuck rank
(watchdog), a drafter rank's micro-batch (micro_batch: its preparation and its sums), the optimizer (optim),
checkpoints (checkpoint), the memory plan (planner), the status line (status), and the measurement of a drafter over
a prompt set (evaluate), which eval_dflash.py and tools/ use too. The drafter step and the optimizer step sit beside the loop in train_dflash.py.
Import the submodules."""
