"""The trainer's library, what train_dflash.py drives: its settings (settings), role setup (roles), the transport
between the roles (pipe) and the watchdog that ends a job on a dead or stuck rank (watchdog), one drafter step
(drafter_step) and its optimizer (optim), checkpoints (checkpoint), the memory plan (planner), the status line
(status), and the measurement of a drafter over a prompt set (evaluate), which eval_dflash.py and tools/ use too.
Import the submodules."""
