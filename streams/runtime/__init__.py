"""The running processes: the transactional task loop, the worker (processor and persister) and the agent runner."""
