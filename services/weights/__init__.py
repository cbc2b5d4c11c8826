"""Pushing new weights to every scheduler over NATS (`sparkwire push-weights`, `WeightPusher`)."""
