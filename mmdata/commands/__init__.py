"""Light command-line modules of subcommands whose work imports heavy libraries: each holds the
subcommand's options and a `run` that imports the work (CLI dispatch, one of the named lazy-import
boundaries), so `mmdata --help` loads no torch, megatron or Ray."""
