"""The driver: the compile configuration, the pipeline loop with its instruments, the stage
cache and stage files."""
