"""Training functions that run on every rank: plain torch, no Prefect."""
