"""Pipeline configs: pydantic models only, no torch, transformers, trl or datasets.

The command line (`--help`), the Prefect UI form, server-side parameter validation and
`prefect deploy` all read these, so they must import fast. The code that runs on the ranks
lives in `trainflow.workloads`, which imports the heavy libraries.
"""
