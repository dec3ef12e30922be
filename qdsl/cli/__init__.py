"""The ``qdsl`` command line: one module per subcommand, dispatched by ``qdsl.cli.main``."""
