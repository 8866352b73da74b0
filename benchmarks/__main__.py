"""`python -m benchmarks`: the compile-time benchmark (see `benchmarks/compile_time.py`)."""

from benchmarks.compile_time import main

if __name__ == "__main__":
    main()
