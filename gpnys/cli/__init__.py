"""The ``gpnys`` command line: one module per subcommand, each exposing ``add_parser`` and ``run``."""
