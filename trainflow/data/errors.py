"""The one error type data preparation and reading raise for bad input."""


class DataError(ValueError):
    """Bad data input: the message names the file, column, split or path at fault."""
