"""One module per ``moetrain`` subcommand; each defines ``add_parser(subparsers)`` that sets ``func``."""
