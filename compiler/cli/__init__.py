"""The command line: a thin layer over the public API (`compiler.api`), and its live display."""
