"""`toolkit serve`: the OpenAI-compatible HTTP server over a continuous-batching engine."""
