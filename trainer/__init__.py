"""The trainer's library, what train_dflash.py drives: its settings (settings), role setup (roles), the transport
between the roles (pipe) and the watchdog that ends a job on a dead or stuck rank (watchdog), one drafter step
(drafter_step) and its optimizer (optim), checkpoints (checkpoint), the memory plan (planner) and the status line
(status). Import the submodules."""
