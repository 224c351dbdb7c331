"""Where an engine step's time goes, one tool with a sub-command per view of it (`python -m benchmarks.step_profile
--help`): step cost by composition, scheduler A/B, host overlap and overhead, the roofline, a decode step's layers."""
