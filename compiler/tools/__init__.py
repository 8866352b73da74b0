"""Tools built on the public API: sweeps over models and backends, the random-program
differential test, Model Explorer, the docs' generated tables."""
