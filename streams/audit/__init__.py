"""Audits and recovery: what the topics recorded, the replay and the rebuild."""
