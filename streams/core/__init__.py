"""The pure core: the filter, UI messages, the model's context and replies; no I/O."""
