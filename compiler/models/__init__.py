"""Models to compile: the built-in examples, the transformers model suite, the catalog of
model specs."""
