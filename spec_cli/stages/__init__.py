"""One module per `spec` command: each takes a config and returns a result for the CLI to print."""
