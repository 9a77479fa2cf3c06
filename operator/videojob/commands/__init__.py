"""The `videojob` subcommands, one module each; `videojob.cli` builds the parser
and dispatches to them. Shared bits (exit codes, quiet output) are in ``common``."""
