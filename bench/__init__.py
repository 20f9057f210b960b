"""tinypipe's benchmarks: `python -m bench --list` (bench/__main__.py); bench/README.md lists every script."""
