"""Model definitions built from configs (no hub downloads needed)."""
