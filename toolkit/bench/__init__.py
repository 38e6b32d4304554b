"""`toolkit bench`: decode and prefill throughput against the machine's bandwidth bound."""
