"""The operator's commands that write history through the log: import and erasure."""
