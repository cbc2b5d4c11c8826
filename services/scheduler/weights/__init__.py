"""New weights without a restart: from disk or pushed over NATS, swapped between two steps."""
