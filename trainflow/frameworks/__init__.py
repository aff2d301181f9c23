"""Training frameworks that run on our ranks from their own environments (.venvs/NAME)."""
