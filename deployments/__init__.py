"""Ways to run trainflow's pipelines as deployments (see prefect.yaml)."""
