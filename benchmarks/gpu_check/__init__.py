"""The one-command GPU check (`benchmarks/gpu_check.sh`): each section runs in its own process with its own time budget
and writes its results as it goes; `__main__` runs them in order and merges them into one JSON and one report."""
