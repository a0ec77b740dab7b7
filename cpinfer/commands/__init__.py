"""One module per `cpinfer` subcommand; each exposes `register(subparsers)`."""
