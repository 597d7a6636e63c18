"""The engine thread's runtime: the Runner, sessions, commands, the loop and its scheduler; executors
only through ``executors.base.Executor``."""
