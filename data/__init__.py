"""Data side: chat templates and masks (chat), the data commands (regenerate, synthesize, filters, prepare, merge,
sources), the prepared set as the trainer reads it (loader) and token-budget batching (batching)."""
