"""The project's benchmarks, each a module run from the repository root as `python -m benchmarks.<name>`; README.md
here maps each to the figures it produces, the result files they go to and where they are quoted."""
