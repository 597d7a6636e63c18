"""The Executor interface (:mod:`.base`), the executors forkline ships and the pieces they share; nothing
here imports the runtime, which drives executors."""
