"""The prefix cache: a token index of stored snapshot handles, their retention and budget, prompt
capture and checkpoints. The bottom room: it imports nothing else of the prefix service."""
