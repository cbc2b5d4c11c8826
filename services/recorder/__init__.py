"""`sparkwire record` / `sparkwire replay`: capture raw NATS message streams and publish them back."""
