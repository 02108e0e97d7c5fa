"""Building blocks of the Llama-family decoder."""
