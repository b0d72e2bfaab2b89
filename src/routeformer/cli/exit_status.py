"""The exit statuses of the `routeformer` command, shared by `main` and the commands that end a run early."""

# Exit statuses: 2 = bad input (arguments, config, a missing or corrupt checkpoint, a path that
# cannot be used); 1 = a run that failed on its own (training diverged); 130 = interrupted.
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130
