"""Command-line interface: argument parsing -> frozen configs -> launch, progress, exit codes."""
