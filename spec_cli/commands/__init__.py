"""The `spec` commands, one module each: a function whose parameters are the command's options (typer
reads them from its signature), which builds its stage's config, runs the stage and prints the result.
The stage is imported inside the function, so `spec --help` imports no torch. Options several commands
take are declared once, in options.py; spec_cli/cli.py registers the commands."""
