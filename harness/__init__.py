"""`harness`: the command-line front end (typer) for runs, sweeps, benchmarks, profiles and figures."""
