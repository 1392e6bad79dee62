"""The `fedsd` command (cli.py) and what it runs, by kind: commands/, deployment/, benchmarks/,
experiments/ (docs/architecture.md)."""
