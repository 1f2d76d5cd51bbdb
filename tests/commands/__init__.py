"""The command lines as a user types them: each command, its bad inputs, the docs' examples."""
