"""Data side: chat templates and masks (chat), prepare/merge commands, token-budget batching."""
